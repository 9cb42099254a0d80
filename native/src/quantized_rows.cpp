// Rows of a quantized table (a quantized embedding's lookup), dequantized, as one graph node.
//
// Why: mx.dequantize on the CPU builds its result from primitive ops (per packed value a shift
// pair, then a concatenation, a cast, the scale's gather, product and the bias's sum): a 4-bit
// embedding lookup is ~45 graph nodes, a decode step's first ~45 of ~340, each costing the CPU
// stream and the submitting thread microseconds whatever its size. Here it is one node.
//
// The values are mx.dequantize's bit for bit: q * scale rounded, then + bias rounded, in
// float32 (this file is compiled without floating-point contraction, so no fused multiply-add
// skips the product's rounding), or in bfloat16 with MLX's rounding of each result.
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx_math.h"
#include "ops.h"

namespace mas {
namespace {

struct RowsArgs {
  const uint32_t* w;  // [vocab, K * bits / 32]
  const void* scales;  // [vocab, K / group], float32 or bfloat16 (raw bits)
  const void* biases;
  const int32_t* ids;  // [n]
  void* out;  // [n, K], float32, or bfloat16 (raw bits) with bf16_out
  int64_t n, vocab, K;
  int group, bits;
  bool bf16_scales, bf16_out;
};

template <typename S, typename T>
void rows(const RowsArgs& a) {
  const auto* sc = static_cast<const S*>(a.scales);
  const auto* bi = static_cast<const S*>(a.biases);
  auto* out = static_cast<T*>(a.out);
  const int per_word = 32 / a.bits;
  const uint32_t mask = (1u << a.bits) - 1;
  const int64_t words = a.K / per_word, groups = a.K / a.group;
  for (int64_t r = 0; r < a.n; ++r) {
    T* o = out + r * a.K;
    const int64_t id = a.ids[r];
    if (id < 0 || id >= a.vocab) {  // outside the table: zeros rather than a stray read
      std::memset(o, 0, a.K * sizeof(T));
      continue;
    }
    const uint32_t* wr = a.w + id * words;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = to_f32(sc[id * groups + g]), b = to_f32(bi[id * groups + g]);
      for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
        const uint32_t q = (wr[k / per_word] >> (a.bits * (k % per_word))) & mask;
        const float t = rounded<T>(static_cast<float>(q) * s);
        store_as(o + k, rounded<T>(t + b));
      }
    }
  }
}

}  // namespace

mx::array quantized_rows(const mx::array& w, const mx::array& scales, const mx::array& biases,
                         const mx::array& ids, int group_size, int bits, bool float32,
                         mx::StreamOrDevice s) {
  const std::string op = "quantized_rows: ";
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument(op + "bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    throw std::invalid_argument(op + "w must be uint32 [vocab, words], got " +
                                shape_str(w.shape()));
  }
  const int64_t K = static_cast<int64_t>(w.shape(1)) * (32 / bits);
  if (group_size <= 0 || K % group_size != 0) {
    throw std::invalid_argument(op + "group_size must divide the rows' " + std::to_string(K) +
                                " values, got " + std::to_string(group_size));
  }
  const mx::Shape stats{w.shape(0), static_cast<int>(K / group_size)};
  if (scales.shape() != stats || biases.shape() != stats || biases.dtype() != scales.dtype() ||
      (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16)) {
    throw std::invalid_argument(op + "scales and biases must be " + shape_str(stats) +
                                ", both float32 or both bfloat16, got " +
                                shape_str(scales.shape()) + " and " + shape_str(biases.shape()));
  }
  if (ids.dtype() != mx::int32 || ids.ndim() != 1) {
    throw std::invalid_argument(op + "ids must be int32 [n], got " + shape_str(ids.shape()));
  }
  mx::Stream stream = cpu_stream(s, "quantized_rows");
  const mx::Dtype out = float32 ? mx::float32 : scales.dtype();
  return mx::array({ids.shape(0), static_cast<int>(K)}, out,
                   std::make_shared<QuantizedRows>(stream, group_size, bits),
                   {w, scales, biases, ids});
}

void QuantizedRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  RowsArgs a{in[0].data<uint32_t>(), in[1].data<void>(), in[2].data<void>(),
             in[3].data<int32_t>(), out.data<void>(), in[3].shape(0), in[0].shape(0),
             out.shape(1), group_, bits_, in[1].dtype() == mx::bfloat16,
             out.dtype() == mx::bfloat16};
  enc.dispatch([a]() {
    if (a.bf16_out) {
      rows<uint16_t, uint16_t>(a);
    } else if (a.bf16_scales) {
      rows<uint16_t, float>(a);
    } else {
      rows<float, float>(a);
    }
  });
}

void QuantizedRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.quantized_rows has no GPU kernel: use mx.dequantize");
}

bool QuantizedRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRows&>(other);
  return group_ == o.group_ && bits_ == o.bits_;
}

}  // namespace mas

// RMS norm and RoPE for the CPU as single graph nodes.
//
// Why: on the CPU, MLX builds mx.fast.rms_norm and mx.fast.rope out of their fallbacks, ~10 and
// ~20 primitive ops each (casts, squares, sums, broadcasts, aranges, cos/sin, concatenations).
// A Qwen3 decode step has 33 norms and 16 RoPEs: ~650 of its ~1,450 graph nodes, each costing
// the CPU stream a few microseconds whatever its size. Here each is one node, one pass over x.
// Float32 only (a bf16 model keeps MLX's path, and with it mlx-lm's exact arithmetic); baseline
// code, single-threaded: at decode sizes a pass is a few microseconds.
#include <cmath>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace mas {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32) {
    throw std::invalid_argument("rms_norm: x and weight must be float32");
  }
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: weight must be [" +
                                std::to_string(x.ndim() ? x.shape(-1) : 0) + "], got x " +
                                shape_str(x.shape()) + " and weight " + shape_str(weight.shape()));
  }
  mx::Stream stream = cpu_stream(s, "rms_norm");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps),
                   {x, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &w = in[1];
  const int64_t D = x.shape(-1), rows = D ? static_cast<int64_t>(x.size()) / D : 0;
  enc.dispatch([xp = x.data<float>(), wp = w.data<float>(), op = out.data<float>(), rows, D,
                eps = eps_]() {
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xp + r * D;
      float* o = op + r * D;
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += xr[d] * xr[d];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * inv * wp[d];
    }
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.rms_norm has no GPU kernel: use mx.fast.rms_norm");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RmsNorm&>(other).eps_;
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offsets, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("rope: x must be float32");
  if (x.ndim() != 4) {
    throw std::invalid_argument("rope: x must be [batch, heads, tokens, dim], got " +
                                shape_str(x.shape()));
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3)) {
    throw std::invalid_argument("rope: dims must be even, positive and at most " +
                                std::to_string(x.shape(3)) + ", got " + std::to_string(dims));
  }
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 ||
      (offsets.shape(0) != 1 && offsets.shape(0) != x.shape(0))) {
    throw std::invalid_argument("rope: offsets must be int32 [1] or [batch] = [" +
                                std::to_string(x.shape(0)) + "], got " +
                                shape_str(offsets.shape()));
  }
  mx::Stream stream = cpu_stream(s, "rope");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, base, scale),
                   {x, offsets});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &offsets = in[1];
  const int64_t B = x.shape(0), H = x.shape(1), T = x.shape(2), D = x.shape(3);
  const int64_t per_row = offsets.shape(0) == 1 ? 0 : 1;
  enc.dispatch([xp = x.data<float>(), off = offsets.data<int32_t>(), op = out.data<float>(), B,
                H, T, D, per_row, dims = dims_, traditional = traditional_, base = base_,
                scale = scale_]() {
    const int64_t half = dims / 2;
    std::vector<float> inv(half), cs(2 * half);
    for (int64_t i = 0; i < half; ++i) {  // base^(-i / half): the rotation speed of pair i
      inv[i] = std::exp(-static_cast<float>(i) * (std::log(base) / static_cast<float>(half)));
    }
    // Pair i of a head is (x[i], x[i + half]), or (x[2i], x[2i + 1]) when traditional.
    const int64_t step = traditional ? 2 : 1, other = traditional ? 1 : half;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const float pos = (static_cast<float>(t) + static_cast<float>(off[b * per_row])) * scale;
        for (int64_t i = 0; i < half; ++i) {
          const float theta = pos * inv[i];
          cs[2 * i] = std::cos(theta);
          cs[2 * i + 1] = std::sin(theta);
        }
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = ((b * H + h) * T + t) * D;
          const float* xr = xp + at;
          float* o = op + at;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = xr[i * step], x2 = xr[i * step + other];
            const float c = cs[2 * i], sn = cs[2 * i + 1];
            o[i * step] = x1 * c - x2 * sn;
            o[i * step + other] = x1 * sn + x2 * c;
          }
          for (int64_t d = dims; d < D; ++d) o[d] = xr[d];  // past dims: unrotated
        }
      }
    }
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.rope has no GPU kernel: use mx.fast.rope");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
         scale_ == o.scale_;
}

}  // namespace mas

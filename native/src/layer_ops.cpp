// RMS norm and RoPE for the CPU as single graph nodes.
//
// Why: on the CPU, MLX builds mx.fast.rms_norm and mx.fast.rope out of their fallbacks, ~10 and
// ~20 primitive ops each (casts, squares, sums, broadcasts, aranges, cos/sin, concatenations).
// A Qwen3 decode step has 33 norms and 16 RoPEs: ~650 of its ~1,450 graph nodes, each costing
// the CPU stream a few microseconds whatever its size. Here each is one node, one pass over x.
// Float32, and bfloat16 with MLX's bf16 arithmetic (its fallbacks' float32 steps, each op's
// result rounded to bf16 where MLX rounds it); baseline code, single-threaded: at decode sizes
// a pass is a few microseconds.
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx_math.h"
#include "ops.h"

namespace mas {
namespace {

// weight * x / sqrt(mean(x^2) + eps) for rows of x [rows, D], as mx.fast.rms_norm's fallback
// computes it: in float32, the mean the sum in order times 1/D; in bf16 x * rsqrt(...) rounded
// to bf16, then its product with the bf16 weight rounded again.
template <typename T>
void rms_rows(const T* xp, const T* wp, T* op, int64_t rows, int64_t D, float eps) {
  const float inv_d = static_cast<float>(1.0 / static_cast<double>(D));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * D;
    T* o = op + r * D;
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d) sum += to_f32(xr[d]) * to_f32(xr[d]);
    const float inv = 1.0f / std::sqrt(sum * inv_d + eps);
    for (int64_t d = 0; d < D; ++d) {
      store_as(o + d, rounded<T>(to_f32(xr[d]) * inv) * to_f32(wp[d]));
    }
  }
}

// `run` with the kernels' element type of `t`: uint16_t (raw bits) for bfloat16, else float.
template <class F>
void by_type(mx::Dtype t, F&& run) {
  if (t == mx::bfloat16) {
    run(uint16_t{});
  } else {
    run(float{});
  }
}

}  // namespace

// An RMS norm's x (or a head of it, `dim` wide) and weight, as rms_norm and norm_rope take them.
void check_norm(const mx::array& x, const mx::array& weight, int dim, const std::string& op) {
  if ((x.dtype() != mx::float32 && x.dtype() != mx::bfloat16) || weight.dtype() != x.dtype()) {
    throw std::invalid_argument(op + "x and weight must be both float32 or both bfloat16");
  }
  if (weight.ndim() != 1 || weight.shape(0) != dim) {
    throw std::invalid_argument(op + "weight must be [" + std::to_string(dim) + "], got x " +
                                shape_str(x.shape()) + " and weight " + shape_str(weight.shape()));
  }
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1) throw std::invalid_argument("rms_norm: x must have at least 1 dimension");
  check_norm(x, weight, x.shape(-1), "rms_norm: ");
  mx::Stream stream = cpu_stream(s, "rms_norm");
  return mx::array(x.shape(), x.dtype(), std::make_shared<RmsNorm>(stream, eps), {x, weight});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &w = in[1];
  const int64_t D = x.shape(-1), rows = D ? static_cast<int64_t>(x.size()) / D : 0;
  const auto run = [&](auto type) {
    using T = decltype(type);
    enc.dispatch([xp = x.data<T>(), wp = w.data<T>(), op = out.data<T>(), rows, D,
                  eps = eps_]() { rms_rows(xp, wp, op, rows, D, eps); });
  };
  by_type(x.dtype(), run);
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.rms_norm has no GPU kernel: use mx.fast.rms_norm");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RmsNorm&>(other).eps_;
}

// RoPE's dims (of a head of `dim`) and offsets (int32 [1] or one per row, `rows` named
// `rows_name` in the message) as rope and norm_rope take them.
void check_rope(int dims, int dim, const mx::array& offsets, int rows, const std::string& op,
                const char* rows_name) {
  if (dims <= 0 || dims % 2 != 0 || dims > dim) {
    throw std::invalid_argument(op + "dims must be even, positive and at most " +
                                std::to_string(dim) + ", got " + std::to_string(dims));
  }
  if (offsets.dtype() != mx::int32 || offsets.ndim() != 1 ||
      (offsets.shape(0) != 1 && offsets.shape(0) != rows)) {
    throw std::invalid_argument(op + "offsets must be int32 [1] or [" + rows_name + "] = [" +
                                std::to_string(rows) + "], got " + shape_str(offsets.shape()));
  }
}

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offsets, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 && x.dtype() != mx::bfloat16) {
    throw std::invalid_argument("rope: x must be float32 or bfloat16");
  }
  if (x.ndim() != 4) {
    throw std::invalid_argument("rope: x must be [batch, heads, tokens, dim], got " +
                                shape_str(x.shape()));
  }
  check_rope(dims, x.shape(3), offsets, x.shape(0), "rope: ", "batch");
  mx::Stream stream = cpu_stream(s, "rope");
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<Rope>(stream, dims, traditional, base, scale),
                   {x, offsets});
}

namespace {

// Rotates x [B, H, T, D] (float32, or bfloat16 as uint16_t) from token t of row b at position
// (t + offsets[b]) * scale. In bf16 as MLX's fallback, bit for bit: its exp for the
// frequencies, its sin/cos rounded to bf16, every product, sum and difference rounded to bf16.
// In float32 the C library's exp, sin and cos (MLX's own are a float32 ulp or two away, ~3e-4
// at positions of thousands with base 1e6, where their argument reduction loses digits).
template <typename T>
void rope_rows(const T* xp, const int32_t* off, T* op, int64_t B, int64_t H, int64_t T_,
               int64_t D, int64_t per_row, int dims, bool traditional, float base, float scale) {
  constexpr bool kBf16 = sizeof(T) == 2;
  const int64_t half = dims / 2;
  std::vector<float> inv(half), cs(2 * half);
  for (int64_t i = 0; i < half; ++i) {  // base^(-i / half): the rotation speed of pair i
    const float e = -static_cast<float>(i) * (std::log(base) / static_cast<float>(half));
    inv[i] = kBf16 ? mlx_exp(e) : std::exp(e);
  }
  // Pair i of a head is (x[i], x[i + half]), or (x[2i], x[2i + 1]) when traditional.
  const int64_t step = traditional ? 2 : 1, other = traditional ? 1 : half;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T_; ++t) {
      const float pos = (static_cast<float>(t) + static_cast<float>(off[b * per_row])) * scale;
      for (int64_t i = 0; i < half; ++i) {
        const float theta = pos * inv[i];
        if (kBf16) {
          mlx_sincos(theta, &cs[2 * i + 1], &cs[2 * i]);
          cs[2 * i] = round_bf16(cs[2 * i]);
          cs[2 * i + 1] = round_bf16(cs[2 * i + 1]);
        } else {
          cs[2 * i] = std::cos(theta);
          cs[2 * i + 1] = std::sin(theta);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const int64_t at = ((b * H + h) * T_ + t) * D;
        const T* xr = xp + at;
        T* o = op + at;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(xr[i * step]), x2 = to_f32(xr[i * step + other]);
          const float c = cs[2 * i], sn = cs[2 * i + 1];
          store_as(o + i * step, rounded<T>(x1 * c) - rounded<T>(x2 * sn));
          store_as(o + i * step + other, rounded<T>(x1 * sn) + rounded<T>(x2 * c));
        }
        for (int64_t d = dims; d < D; ++d) o[d] = xr[d];  // past dims: unrotated
      }
    }
  }
}

}  // namespace

void rms_rows_f32(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps) {
  rms_rows(x, weight, out, rows, dim, eps);
}

void rope_rows_f32(const float* x, const int32_t* offsets, float* out, int64_t rows,
                   int64_t heads, int64_t dim, int64_t per_row, int dims, bool traditional,
                   float base, float scale) {
  rope_rows(x, offsets, out, rows, heads, int64_t{1}, dim, per_row, dims, traditional, base,
            scale);
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &offsets = in[1];
  const int64_t B = x.shape(0), H = x.shape(1), T = x.shape(2), D = x.shape(3);
  const int64_t per_row = offsets.shape(0) == 1 ? 0 : 1;
  const auto run = [&](auto type) {
    using E = decltype(type);
    enc.dispatch([xp = x.data<E>(), off = offsets.data<int32_t>(), op = out.data<E>(), B, H, T,
                  D, per_row, dims = dims_, traditional = traditional_, base = base_,
                  scale = scale_]() {
      rope_rows(xp, off, op, B, H, T, D, per_row, dims, traditional, base, scale);
    });
  };
  by_type(x.dtype(), run);
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.rope has no GPU kernel: use mx.fast.rope");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
         scale_ == o.scale_;
}

mx::array norm_rope(const mx::array& x, const mx::array& weight, float eps, int heads, int dims,
                    bool traditional, float base, float scale, const mx::array& offsets,
                    mx::StreamOrDevice s) {
  if (x.ndim() != 3 || x.shape(1) != 1 || heads <= 0 || x.shape(2) % heads != 0) {
    throw std::invalid_argument("norm_rope: x must be [rows, 1, heads x dim] with " +
                                std::to_string(heads) + " heads, got " + shape_str(x.shape()));
  }
  const int D = x.shape(2) / heads;
  check_norm(x, weight, D, "norm_rope: ");
  check_rope(dims, D, offsets, x.shape(0), "norm_rope: ", "rows");
  mx::Stream stream = cpu_stream(s, "norm_rope");
  return mx::array({x.shape(0), heads, 1, D}, x.dtype(),
                   std::make_shared<NormRope>(stream, eps, dims, traditional, base, scale),
                   {x, weight, offsets});
}

// rms_norm then rope, as their two nodes compute them (the same functions, in order), on the
// one buffer: [rows, 1, heads x dim] is [rows, heads, 1, dim] in memory.
void NormRope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &w = in[1], &offsets = in[2];
  const int64_t B = out.shape(0), H = out.shape(1), D = out.shape(3);
  const int64_t per_row = offsets.shape(0) == 1 ? 0 : 1;
  const auto run = [&](auto type) {
    using E = decltype(type);
    enc.dispatch([xp = x.data<E>(), wp = w.data<E>(), off = offsets.data<int32_t>(),
                  op = out.data<E>(), B, H, D, per_row, eps = eps_, dims = dims_,
                  traditional = traditional_, base = base_, scale = scale_]() {
      rms_rows(xp, wp, op, B * H, D, eps);
      rope_rows(op, off, op, B, H, int64_t{1}, D, per_row, dims, traditional, base, scale);
    });
  };
  by_type(x.dtype(), run);
}

void NormRope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.norm_rope has no GPU kernel: use mx.fast's");
}

std::vector<mx::Shape> NormRope::output_shapes(const std::vector<mx::array>& inputs) {
  const int D = inputs[1].shape(0);
  return {{inputs[0].shape(0), inputs[0].shape(2) / D, 1, D}};
}

bool NormRope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const NormRope&>(other);
  return eps_ == o.eps_ && dims_ == o.dims_ && traditional_ == o.traditional_ &&
         base_ == o.base_ && scale_ == o.scale_;
}

}  // namespace mas

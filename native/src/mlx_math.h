// MLX's own float arithmetic on x86, reproduced bit for bit where a bf16 model's kernels must
// give MLX's bf16 results: its rounding to bfloat16, its exp and its sin/cos (Cephes'
// polynomials, evaluated as mlx/backend/cpu/simd/math.h evaluates them for Simd<float, 1>).
// A float32 result one ulp off rounds to another bf16 now and then, and greedy tokens of a
// bf16 model can follow it. All functions are static (each file that includes this gets its
// own copies, compiled for its own instruction set); floor and fma are exact operations, so a
// file may vectorize them.
#pragma once

#include <cstdint>

namespace mas {

// A bfloat16's bits as the float32 it is.
static inline float from_bf16(uint16_t v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
}

// x to the nearest bfloat16 (ties to even, NaN kept), as a float: how MLX rounds every result.
static inline float round_bf16(float x) {
  const uint32_t i = __builtin_bit_cast(uint32_t, x);
  const float r = __builtin_bit_cast(float, (i + 0x7FFFu + ((i >> 16) & 1u)) & 0xFFFF0000u);
  return x != x ? x : r;
}

static inline uint16_t to_bf16(float x) {
  return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, round_bf16(x)) >> 16);
}

// Kernels written once for float32 (T float) and bfloat16 (T uint16_t, raw bits): a value
// read as float32, a float32 result stored, and a result as MLX gives it in T (bf16: rounded).
static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t x) { return from_bf16(x); }
static inline void store_as(float* p, float x) { *p = x; }
static inline void store_as(uint16_t* p, float x) { *p = to_bf16(x); }
template <typename T>
static inline float rounded(float x) {
  return sizeof(T) == 2 ? round_bf16(x) : x;
}

// exp(x) = 2^i p(f), i = floor(x log2(e) + 1/2), f the rest, p Cephes' degree-6 polynomial;
// inf above 88, 0 below -88.
static inline float mlx_exp(float x) {
  const float xc = x >= -88.0f ? (x <= 88.0f ? x : 88.0f) : -88.0f;  // NaN too: no int overflow
  // fma(x, c, 0): the product rounded, as MLX computes it. A plain product could be contracted
  // by the compiler into the fma of `t + 0.5f` or `t - ip`, unrounded.
  const float t = __builtin_fmaf(xc, 1.442695f, 0.0f);
  const float ip = __builtin_floorf(t + 0.5f);
  const float f = t - ip;
  float p = 1.535336188319500e-4f;
  p = __builtin_fmaf(p, f, 1.339887440266574e-3f);
  p = __builtin_fmaf(p, f, 9.618437357674640e-3f);
  p = __builtin_fmaf(p, f, 5.550332471162809e-2f);
  p = __builtin_fmaf(p, f, 2.402264791363012e-1f);
  p = __builtin_fmaf(p, f, 6.931472028550421e-1f);
  p = __builtin_fmaf(p, f, 1.0f);
  const float r = __builtin_bit_cast(float, (static_cast<int32_t>(ip) + 127) << 23) * p;
  const float r1 = x != x ? x : r;
  const float r2 = x > 88.0f ? __builtin_inff() : r1;
  return x < -88.0f ? 0.0f : r2;
}

// sin and cos of x: x reduced by the nearest even multiple j of pi/4 (pi/4 in three parts),
// one of two polynomials on the rest by j's bit 1, the signs by j's bit 2. Past 2^23 the
// reduction is not exact and MLX asks the C library.
static inline void mlx_sincos(float x, float* sin_out, float* cos_out) {
  const float a = x < 0.0f ? -x : x;
  if (a > 8388608.0f) {
    *sin_out = __builtin_sinf(x);
    *cos_out = __builtin_cosf(x);
    return;
  }
  uint32_t j = static_cast<uint32_t>(a * 1.27323954473516f);  // 4 / pi
  j = (j + 1) & ~1u;
  const float y = static_cast<float>(j);
  float r = __builtin_fmaf(y, -0.78515625f, a);
  r = __builtin_fmaf(y, -2.4187564849853515625e-4f, r);
  r = __builtin_fmaf(y, -3.77489497744594108e-8f, r);
  const float z = r * r;
  float c = __builtin_fmaf(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
  float s = __builtin_fmaf(z, -1.9515295891e-4f, 8.3321608736e-3f);
  c = __builtin_fmaf(c, z, 4.166664568298827e-2f);
  s = __builtin_fmaf(s, z, -1.6666654611e-1f);
  c = c * z;
  s = s * z;
  c = c * z;
  s = __builtin_fmaf(r, s, r);
  c = __builtin_fmaf(z, -0.5f, c);
  c = c + 1.0f;
  const bool swap = (j & 2) != 0;
  const float sv = swap ? c : s, cv = swap ? s : c;
  const bool sin_negative = (x < 0.0f) != ((j & 4) != 0);
  const bool cos_positive = ((j - 2) & 4) != 0;
  *sin_out = sin_negative ? -sv : sv;
  *cos_out = cos_positive ? cv : -cv;
}

}  // namespace mas

// AVX-512 path (F, BW, VL, DQ): 16-lane float32 FMAs, weights decoded in registers.
//
// 4-bit: 16 bytes (32 values) are broadcast to the four 128-bit lanes; one variable shift per
//   16 values brings nibble a of dword d to lane 4a + d, and vpermps looks the nibble up in a
//   16-entry table holding scale * q + bias for the group (one FMA per group builds it), so a
//   value costs a shift and a permute, never an int->float conversion.
// 8-bit: vpmovzxbd + vcvtdq2ps + one FMA (scale, bias) per 16 values, k order unchanged.
// bf16: vpunpck{l,h}wd with zero puts each bf16 in the high half of a float32 lane. Not
//   vdpbf16ps: it takes x in bf16 too, and keeping float32-grade results needs x split into
//   two bf16 parts, which measured no faster than widen + FMA on Zen 4 (0.81 vs 0.68 ns per 32
//   weights at M=1, 2.35 vs 2.21 at M=4); only x rounded to one bf16 (2x faster) would pay,
//   and that changes results.
// Built with -mtune=icelake-server: GCC 12's generic tuning spills the x vectors and group
// tables of the direct tiles to the stack (the loads then bound the loop); the tuning only
// changes scheduling and register choices, not the instructions allowed.
#include <immintrin.h>

#include "avx512_base.h"
#include "kernels.h"
#include "mlx_math.h"

namespace mas::avx512 {
namespace {

constexpr int CH = 32;
constexpr int64_t kGB = 32;  // groups whose scales are widened at once
constexpr int kDirectNR1 = 8, kDirectNR = 4;  // rows per direct tile: M = 1, M = 2..4
constexpr int kMicroMR = 4, kMicroNR = 4;
// driver.inc's outer-product form stays off here (measured on AVX2 only).
constexpr int64_t kOuterMinM = INT64_MAX;
constexpr int kOuterMR = 4;

// dst[i] = src[perm[i]], i < 32: two-source permutes.
inline void permute_chunk(const float* src, float* dst, const int* perm) {
  const vf lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const __m512i i0 = _mm512_loadu_si512(perm), i1 = _mm512_loadu_si512(perm + 16);
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, i0, hi));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, i1, hi));
}

// out[i] = float32(p[i0 + i]) for i < count.
template <ScaleType ST>
inline void widen_scales(const void* p, int64_t i0, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = count - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - i)) - 1);
    vf v;
    if constexpr (ST == ScaleType::f32) {
      v = _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i0 + i);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i0 + i);
      if constexpr (ST == ScaleType::bf16) {
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        v = _mm512_cvtph_ps(h);
      }
    }
    _mm512_mask_storeu_ps(out + i, m, v);
  }
}

// Decode orders: chunk value i holds k = c * CH + perm[i].
struct Perms {
  int q4[CH], id[CH], bf16[CH];
  constexpr Perms() : q4(), id(), bf16() {
    for (int i = 0; i < CH; ++i) {
      const int j = i % 16, a = j / 4, d = j % 4;
      q4[i] = 8 * d + a + (i < 16 ? 0 : 4);  // nibble a (+4) of dword d
      id[i] = i;
      bf16[i] = 8 * a + d + (i < 16 ? 0 : 4);  // 128-bit lane a, word d (+4)
    }
  }
};
constexpr Perms kPerms{};  // built by the compiler: no code of this file runs at load time

// The fields and widen() of the two affine formats.
template <ScaleType ST>
struct Affine {
  static constexpr bool kTail = false;
  const uint8_t* w;
  const void *s, *b;
  int64_t row_bytes, ngroups, cpg;
  bool has_tail = false;

  struct Row {
    const uint8_t* w;
    int64_t g0;  // index of the row's first scale
  };
  Row row(int64_t n) const { return {w + n * row_bytes, n * ngroups}; }
  void widen(const Row& r, int64_t g0, int64_t count, float* so, float* bo) const {
    widen_scales<ST>(s, r.g0 + g0, count, so);
    widen_scales<ST>(b, r.g0 + g0, count, bo);
  }
  void tail(const Row&, int64_t, vf&, vf&) const {}
};

template <ScaleType ST>
struct Q4 : Affine<ST> {
  static constexpr int kBytes = 16;  // per chunk
  const int* perm = kPerms.q4;
  using Row = typename Affine<ST>::Row;

  struct Grp {
    vf table;  // scale * q + bias for q = 0..15
  };
  Grp group(float scale, float bias) const {
    const vf iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(bias))};
  }
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * this->row_bytes + c * kBytes),
                 _MM_HINT_T0);
  }
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    const __m512i sh0 = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m512i sh1 = _mm512_add_epi32(sh0, _mm512_set1_epi32(16));
    const __m512i v = _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.w + c * kBytes)));
    w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh0), g.table);
    w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh1), g.table);
  }
};

template <ScaleType ST>
struct Q8 : Affine<ST> {
  static constexpr int kBytes = 32;  // per chunk
  const int* perm = kPerms.id;
  using Row = typename Affine<ST>::Row;

  struct Grp {
    vf scale, bias;
  };
  Grp group(float scale, float bias) const { return {_mm512_set1_ps(scale), _mm512_set1_ps(bias)}; }
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * this->row_bytes + c * kBytes),
                 _MM_HINT_T0);
  }
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    const uint8_t* p = r.w + c * kBytes;
    const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i q1 =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), g.scale, g.bias);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), g.scale, g.bias);
  }
};

#include "dense.inc"

struct Bf16 : Dense<uint16_t> {
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * K + c * CH), _MM_HINT_T0);
  }
  static void widen16(__m512i v, vf& w0, vf& w1) {
    const __m512i z = _mm512_setzero_si512();
    w0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
    w1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
  }
  void chunk(const Row& r, int64_t c, const Grp&, vf& w0, vf& w1) const {
    widen16(_mm512_loadu_si512(r.w + c * CH), w0, w1);
  }
  void tail(const Row& r, int64_t c, vf& w0, vf& w1) const {
    const __mmask32 m = _cvtu32_mask32((1u << (K - c * CH)) - 1);
    widen16(_mm512_maskz_loadu_epi16(m, r.w + c * CH), w0, w1);
  }
};

// float32 weights: the "decode" is a plain load, k order unchanged.
struct F32 : Dense<float> {
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    const char* p = reinterpret_cast<const char*>(r.w + rows_ahead * K + c * CH);
    _mm_prefetch(p, _MM_HINT_T0);  // a chunk of 32 floats is two cache lines
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
  void chunk(const Row& r, int64_t c, const Grp&, vf& w0, vf& w1) const {
    w0 = _mm512_loadu_ps(r.w + c * CH);
    w1 = _mm512_loadu_ps(r.w + c * CH + W);
  }
  void tail(const Row& r, int64_t c, vf& w0, vf& w1) const {
    const int64_t left = K - c * CH;  // 1 .. CH - 1
    const __mmask16 m0 = left >= W ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m1 = left > W ? static_cast<__mmask16>((1u << (left - W)) - 1) : 0;
    w0 = _mm512_maskz_loadu_ps(m0, r.w + c * CH);
    w1 = _mm512_maskz_loadu_ps(m1, r.w + c * CH + W);
  }
};

#include "driver.inc"

}  // namespace

#include "entries.inc"
#include "attention.inc"
#include "gated_delta.inc"
#include "activation.inc"
#include "sampling.inc"
}  // namespace mas::avx512

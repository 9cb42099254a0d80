// AVX2 + FMA + F16C path: 8-lane float32 FMAs, weights decoded in registers.
//
// 4-bit: 8 bytes (16 values) are broadcast to every 64-bit lane; a variable shift and a mask
//   bring nibble a of dword d to lane 2a + d, then vcvtdq2ps and one FMA (scale, bias).
// 8-bit: vpmovzxbd + vcvtdq2ps + FMA per 8 values, k order unchanged.
// 4-bit at one row of x (decode at one row) skips the (scale, bias) FMA: driver.inc's
//   sum_tile takes the codes as float times x, and applies a group's scale and bias once.
//   qwen3-small's 4-bit layer products at one row, in-process A/B (6 alternating rounds): 2.18
//   vs 2.44 ms. Not 8-bit: 2.44 vs 2.41 ms (its loads, not its arithmetic, bound it), and its
//   bias (about -128 scales) cancels more of s * sum(x q) than a 4-bit one does.
// The greedy heads (int8 screening, the quantized head's own codes) are in head_avx2.cpp.
// bf16: vpunpck{l,h}wd with zero puts each bf16 in the high half of a float32 lane.
#include <immintrin.h>

#include "kernels.h"
#include "mlx_math.h"

namespace mas::avx2 {
namespace {

using vf = __m256;
constexpr int W = 8;
constexpr int CH = 16;
constexpr int64_t kGB = 32;  // groups whose scales are widened at once
static_assert(kGB % 8 == 0, "widen_scales stores whole vectors");
constexpr int kDirectNR1 = 4, kDirectNR = 2;  // rows per direct tile: M = 1, M = 2..4
constexpr int kMicroMR = 4, kMicroNR = 2;
// From this many rows of x the scratch path takes the outer-product form (driver.inc's outer),
// kOuterMR rows at a time: 12 accumulators.
constexpr int64_t kOuterMinM = 24;
constexpr int kOuterMR = 6;

inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }

inline void reduce(const vf* acc, int n, float* res) {
  for (int i = 0; i < n; ++i) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    res[i] = _mm_cvtss_f32(s);
  }
}

template <ScaleType ST>
inline float load_scale(const void* p, int64_t i) {
  if constexpr (ST == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::bf16) {
    return _mm_cvtss_f32(_mm_castsi128_ps(
        _mm_cvtsi32_si128(static_cast<int>(static_cast<const uint16_t*>(p)[i]) << 16)));
  } else {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void permute_chunk(const float* src, float* dst, const int* perm) {
  for (int i = 0; i < CH; ++i) dst[i] = src[perm[i]];
}

// out[i] = float32(p[i0 + i]) for i < count.
template <ScaleType ST>
inline void widen_scales(const void* p, int64_t i0, int64_t count, float* out) {
  int64_t i = 0;
  if constexpr (ST == ScaleType::f32) {
    // GCC recognises this copy (even as vector moves) and emits `rep movsq`, whose start-up
    // cost was ~27% of a one-row 4-bit product: CMakeLists.txt builds this file with
    // -fno-tree-loop-distribute-patterns (test_no_string_moves_in_the_product_tiles).
    // out always has room for kGB floats (a multiple of 8), so every store is whole.
    const float* f = static_cast<const float*>(p) + i0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_loadu_ps(f + i));
    if (i < count) {
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - i)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      _mm256_storeu_ps(out + i, _mm256_maskload_ps(f + i, m));
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p) + i0;
    for (; i + 8 <= count; i += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
      if constexpr (ST == ScaleType::bf16) {
        const __m256i f = _mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16);
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(f));
      } else {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(v));
      }
    }
    for (; i < count; ++i) out[i] = load_scale<ST>(p, i0 + i);
  }
}

struct Perms {
  int q4[CH], id[CH], bf16[CH];
  constexpr Perms() : q4(), id(), bf16() {
    for (int i = 0; i < CH; ++i) {
      const int j = i % 8;
      q4[i] = 8 * (j % 2) + j / 2 + (i < 8 ? 0 : 4);  // nibble j/2 (+4) of dword j%2
      id[i] = i;
      bf16[i] = 8 * (j / 4) + j % 4 + (i < 8 ? 0 : 4);  // 128-bit lane j/4, word j%4 (+4)
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
  struct Grp {
    vf scale, bias;
  };
  Row row(int64_t n) const { return {w + n * row_bytes, n * ngroups}; }
  void widen(const Row& r, int64_t g0, int64_t count, float* so, float* bo) const {
    widen_scales<ST>(s, r.g0 + g0, count, so);
    widen_scales<ST>(b, r.g0 + g0, count, bo);
  }
  Grp group(float scale, float bias) const { return {_mm256_set1_ps(scale), _mm256_set1_ps(bias)}; }
  void tail(const Row&, int64_t, vf&, vf&) const {}
};

template <ScaleType ST>
struct Q4 : Affine<ST> {
  static constexpr int kBytes = 8;  // per chunk
  // One row of x takes the sum form (driver.inc's sum_tile): the codes as float, times x.
  static constexpr bool kSumForm = true;
  // ... and in integers where it can (q4_pieces.inc).
  static constexpr bool kPieces = true;
  const int* perm = kPerms.q4;
  using Row = typename Affine<ST>::Row;
  using Grp = typename Affine<ST>::Grp;

  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * this->row_bytes + c * kBytes),
                 _MM_HINT_T0);
  }
  // The chunk's codes as float32.
  void codes(const Row& r, int64_t c, vf& q0, vf& q1) const {
    const __m256i sh0 = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
    const __m256i sh1 = _mm256_add_epi32(sh0, _mm256_set1_epi32(16));
    const __m256i mask = _mm256_set1_epi32(15);
    long long bits;
    __builtin_memcpy(&bits, r.w + c * kBytes, 8);
    const __m256i v = _mm256_set1_epi64x(bits);
    q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh0), mask));
    q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, sh1), mask));
  }
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    codes(r, c, w0, w1);
    w0 = _mm256_fmadd_ps(w0, g.scale, g.bias);
    w1 = _mm256_fmadd_ps(w1, g.scale, g.bias);
  }
};

template <ScaleType ST>
struct Q8 : Affine<ST> {
  static constexpr int kBytes = 16;  // per chunk
  const int* perm = kPerms.id;
  using Row = typename Affine<ST>::Row;
  using Grp = typename Affine<ST>::Grp;

  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * this->row_bytes + c * kBytes),
                 _MM_HINT_T0);
  }
  void codes(const Row& r, int64_t c, vf& q0, vf& q1) const {
    const uint8_t* p = r.w + c * kBytes;
    q0 = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    q1 = _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    codes(r, c, w0, w1);
    w0 = _mm256_fmadd_ps(w0, g.scale, g.bias);
    w1 = _mm256_fmadd_ps(w1, g.scale, g.bias);
  }
};

#include "dense.inc"

struct Bf16 : Dense<uint16_t> {
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * K + c * CH), _MM_HINT_T0);
  }
  static void widen16(__m256i v, vf& w0, vf& w1) {
    const __m256i z = _mm256_setzero_si256();
    w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
  void chunk(const Row& r, int64_t c, const Grp&, vf& w0, vf& w1) const {
    widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.w + c * CH)), w0, w1);
  }
  void tail(const Row& r, int64_t c, vf& w0, vf& w1) const {
    alignas(32) uint16_t buf[CH] = {};
    for (int64_t i = 0; i < K - c * CH; ++i) buf[i] = r.w[c * CH + i];
    widen16(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)), w0, w1);
  }
};

// float32 weights: the "decode" is a plain load, k order unchanged.
struct F32 : Dense<float> {
  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * K + c * CH), _MM_HINT_T0);
  }
  void chunk(const Row& r, int64_t c, const Grp&, vf& w0, vf& w1) const {
    w0 = _mm256_loadu_ps(r.w + c * CH);
    w1 = _mm256_loadu_ps(r.w + c * CH + W);
  }
  void tail(const Row& r, int64_t c, vf& w0, vf& w1) const {
    alignas(32) float buf[CH] = {};
    for (int64_t i = 0; i < K - c * CH; ++i) buf[i] = r.w[c * CH + i];
    w0 = _mm256_load_ps(buf);
    w1 = _mm256_load_ps(buf + W);
  }
};

#include "driver.inc"
#include "q4_pieces.inc"

}  // namespace

#include "entries.inc"
#include "attention.inc"
#include "gated_delta.inc"
#include "activation.inc"
#include "sampling.inc"
}  // namespace mas::avx2

// AVX2 + FMA + F16C path: 8-lane float32 FMAs, weights decoded in registers.
//
// 4-bit: 8 bytes (16 values) are broadcast to every 64-bit lane; a variable shift and a mask
//   bring nibble a of dword d to lane 2a + d, then vcvtdq2ps and one FMA (scale, bias).
// 8-bit: vpmovzxbd + vcvtdq2ps + FMA per 8 values, k order unchanged.
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
constexpr int kDirectNR1 = 4, kDirectNR = 2;  // rows per direct tile: M = 1, M = 2..4
constexpr int kMicroMR = 4, kMicroNR = 2;

inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }

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
    for (; i < count; ++i) out[i] = static_cast<const float*>(p)[i0 + i];
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
  const int* perm = kPerms.q4;
  using Row = typename Affine<ST>::Row;
  using Grp = typename Affine<ST>::Grp;

  void prefetch(const Row& r, int64_t c, int rows_ahead) const {
    _mm_prefetch(reinterpret_cast<const char*>(r.w + rows_ahead * this->row_bytes + c * kBytes),
                 _MM_HINT_T0);
  }
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    const __m256i sh0 = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
    const __m256i sh1 = _mm256_add_epi32(sh0, _mm256_set1_epi32(16));
    const __m256i mask = _mm256_set1_epi32(15);
    long long bits;
    __builtin_memcpy(&bits, r.w + c * kBytes, 8);
    const __m256i v = _mm256_set1_epi64x(bits);
    const __m256i q0 = _mm256_and_si256(_mm256_srlv_epi32(v, sh0), mask);
    const __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(v, sh1), mask);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), g.scale, g.bias);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), g.scale, g.bias);
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
  void chunk(const Row& r, int64_t c, const Grp& g, vf& w0, vf& w1) const {
    const uint8_t* p = r.w + c * kBytes;
    const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i q1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), g.scale, g.bias);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), g.scale, g.bias);
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

}  // namespace

#include "entries.inc"
#include "attention.inc"
#include "gated_delta.inc"
#include "activation.inc"
#include "sampling.inc"
#include "head.inc"

namespace {

// res[i] = sum of the 8 lanes of acc[i], i < 8.
inline void reduce8_epi32(const __m256i* acc, int32_t* res) {
  const __m256i t0 = _mm256_hadd_epi32(acc[0], acc[1]), t1 = _mm256_hadd_epi32(acc[2], acc[3]);
  const __m256i t2 = _mm256_hadd_epi32(acc[4], acc[5]), t3 = _mm256_hadd_epi32(acc[6], acc[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  // u0 = [sums of acc 0-3 over the low 128 bits | over the high 128 bits], u1 for acc 4-7.
  const __m256i r = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                     _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(res), r);
}

// vpmaddubsw multiplies w's unsigned bytes by x's signed ones and adds pairs into int16 with
// saturation: x is quantized to [-63, 63] on this path (head_x_levels), so 255 * 63 * 2 fits.
// Register tiles of 4 rows of W x MR (<= 2) rows of x.
template <int MR>
void head_dots(const HeadArgs& a, const uint8_t* const* rows, int64_t m0, int32_t* dots) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = a.x + (m0 + i) * a.Kp;
  for (int sub = 0; sub < kHeadTile / 4; ++sub) {
    const uint8_t* w[4] = {rows[4 * sub], rows[4 * sub + 1], rows[4 * sub + 2],
                           rows[4 * sub + 3]};
    __m256i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < a.Kp; k += 32) {
      __m256i x[MR];
      for (int i = 0; i < MR; ++i) {
        x[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + k));
      }
      for (int r = 0; r < 4; ++r) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
        for (int i = 0; i < MR; ++i) {
          acc[4 * i + r] = _mm256_add_epi32(
              acc[4 * i + r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, x[i]), ones));
        }
      }
    }
    alignas(32) int32_t res[8];
    // A copy: acc's address never escapes, so it can stay in registers through the k loop.
    __m256i fin[8];
    for (int j = 0; j < 8; ++j) fin[j] = acc[j];
    reduce8_epi32(fin, res);
    for (int i = 0; i < MR; ++i) {
      for (int r = 0; r < 4; ++r) dots[i * kHeadTile + 4 * sub + r] = res[4 * i + r];
    }
  }
}

void head_task(void* ctx, int64_t task) {
  const HeadArgs& a = *static_cast<const HeadArgs*>(ctx);
  head_run<2>(a, task, [&a](const uint8_t* const* rows, int64_t m0, int mr, int32_t* out,
                            const uint8_t*) {
    if (mr == 2) {
      head_dots<2>(a, rows, m0, out);
    } else {
      head_dots<1>(a, rows, m0, out);
    }
  });
}

}  // namespace

void head(const HeadArgs& a) {
  parallel_for((a.N + a.rows_per_task - 1) / a.rows_per_task, head_task,
               const_cast<HeadArgs*>(&a));
}

}  // namespace mas::avx2

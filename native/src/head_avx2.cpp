// The greedy head on AVX2: the int8 screening of a float32 or bf16 head's copy, and a
// quantized head's screening over its own codes (greedy_head.cpp drives both, head.inc holds
// the per-tile logic every ISA shares). Built with the flags of kernels_avx2.cpp.
#include <immintrin.h>

#include <vector>

#include "kernels.h"

namespace mas::avx2 {

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

// res[i] = sum of the 8 lanes of v[i], i < 8: reduce8_epi32's tree in float32.
inline __m256 reduce8_ps(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Entry i of the scale/bias table as float32, and 8 of them from i on: with HALF from its
// float16 copy (QHeadArgs::screen), half the bytes, widened by F16C.
template <bool HALF>
inline float table_at(const QHeadArgs& q, int64_t i) {
  if constexpr (HALF) {
    return _cvtsh_ss(q.screen[i]);
  } else {
    return q.table[i];
  }
}
template <bool HALF>
inline __m256 table_8(const QHeadArgs& q, int64_t i) {
  if constexpr (HALF) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.screen + i)));
  } else {
    return _mm256_loadu_ps(q.table + i);
  }
}

// The quantized head: a block's 16 code rows read as they lie, 32 bytes at a time, each
// against up to 4 rows of x. vpmaddubsw multiplies the codes (unsigned) by x's bytes (signed,
// within +-63: head_x_levels) and adds pairs into int16 (8-bit: 2 * 255 * 63 fits; 4-bit: the
// low and high nibbles' two products, 4 * 15 * 63, too); vpmaddwd by ones adds those pairs
// into int32 lanes of one 32-bit word each (4 codes of 8 bits, 8 of 4). A group's lanes are
// converted once and scaled by its scale in float lanes; 8 code rows' lanes meet in one
// transposing tree, then the biases meet x's group sums. x is laid out once per call (qhead):
// 8-bit as it is, 4-bit per 64 bytes (the run of 8 values of each of 8 words: 4 low-nibble
// values, 4 high) as the 32 low-nibble bytes, then the 32 high ones, so both line up with a
// 32-byte chunk's nibbles after one mask and one shift.
template <int BITS, int GS, bool HALF, int MR>
void qhead_dots(const QHeadArgs& q, const uint8_t* const* block, int64_t n0, const int8_t* xd,
                int64_t m0, float* out) {
  const HeadArgs& a = q.h;
  constexpr int kValues = BITS == 4 ? 64 : 32;  // per 32-byte chunk of codes
  // A chunk spans two groups where 4-bit groups hold 32 values: lanes 0-3, then 4-7.
  constexpr bool kSplit = GS < kValues;
  constexpr int kChunks = kSplit ? 1 : GS / kValues;  // per group (or per pair of groups)
  const int64_t chunks = q.row_words / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t tab = (n0 / kHeadTile) * q.G * 32;  // this block's slice of the table
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = xd + (m0 + i) * a.Kp;
  __m256 sums[MR][kHeadTile];
  for (int j = 0; j < kHeadTile; ++j) {
    const uint8_t* w = block[j];
    __m256 accf[MR];
    for (int i = 0; i < MR; ++i) accf[i] = _mm256_setzero_ps();
    int64_t g = 0;
    for (int64_t c = 0; c < chunks; g += kSplit ? 2 : 1) {
      __m256i acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
      for (int cc = 0; cc < kChunks; ++cc, ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
        if constexpr (BITS == 4) {
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int i = 0; i < MR; ++i) {
            const int8_t* x = xr[i] + 64 * c;
            const __m256i p = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                _mm256_maddubs_epi16(
                    hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
          }
        } else {
          for (int i = 0; i < MR; ++i) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + 32 * c));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(v, xv), ones));
          }
        }
      }
      __m256 scale = _mm256_set1_ps(table_at<HALF>(q, tab + g * 32 + j));
      if constexpr (kSplit) {
        scale = _mm256_blend_ps(scale, _mm256_set1_ps(table_at<HALF>(q, tab + (g + 1) * 32 + j)),
                                0xF0);
      }
      for (int i = 0; i < MR; ++i) {
        accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), scale, accf[i]);
      }
    }
    for (int i = 0; i < MR; ++i) sums[i][j] = accf[i];
  }
  for (int i = 0; i < MR; ++i) {
    const float* xsum = q.xsum + (m0 + i) * q.G;
    const __m256 xs = _mm256_set1_ps(a.xscale[m0 + i]);
    for (int h = 0; h < kHeadTile; h += 8) {
      __m256 s = reduce8_ps(sums[i] + h);
      for (int64_t gg = 0; gg < q.G; ++gg) {
        s = _mm256_fmadd_ps(table_8<HALF>(q, tab + gg * 32 + 16 + h), _mm256_set1_ps(xsum[gg]),
                            s);
      }
      _mm256_storeu_ps(out + i * kHeadTile + h, _mm256_mul_ps(s, xs));
    }
  }
}

template <int BITS, int GS, bool HALF>
void qhead_task(void* ctx, int64_t task) {
  const QHeadArgs& q = *static_cast<const QHeadArgs*>(ctx);
  const int8_t* xd = q.h.x;  // laid out by qhead
  const uint8_t* block[kHeadTile];
  int64_t base = 0;
  qhead_run<4>(
      q, task,
      [&](int64_t n0, const uint32_t* const* rows) {
        base = n0;
        for (int j = 0; j < kHeadTile; ++j) block[j] = reinterpret_cast<const uint8_t*>(rows[j]);
      },
      [&](int64_t m0, int mr, float* out) {
        switch (mr) {
          case 4: return qhead_dots<BITS, GS, HALF, 4>(q, block, base, xd, m0, out);
          case 3: return qhead_dots<BITS, GS, HALF, 3>(q, block, base, xd, m0, out);
          case 2: return qhead_dots<BITS, GS, HALF, 2>(q, block, base, xd, m0, out);
          default: return qhead_dots<BITS, GS, HALF, 1>(q, block, base, xd, m0, out);
        }
      });
}

template <int BITS, bool HALF>
void (*qhead_task_for(int group_size))(void*, int64_t) {
  return group_size == 32   ? qhead_task<BITS, 32, HALF>
         : group_size == 64 ? qhead_task<BITS, 64, HALF>
                            : qhead_task<BITS, 128, HALF>;
}

template <int BITS>
void qhead_bits(const QHeadArgs& a) {
  void (*task)(void*, int64_t) = a.screen != nullptr ? qhead_task_for<BITS, true>(a.group_size)
                                                     : qhead_task_for<BITS, false>(a.group_size);
  QHeadArgs q = a;
  std::vector<int8_t> xd;
  if constexpr (BITS == 4) {  // per 64 bytes: bytes 0-3 of each run of 8, then bytes 4-7
    xd.resize(static_cast<size_t>(a.h.M * a.h.Kp));
    for (int64_t at = 0; at < a.h.M * a.h.Kp; at += 64) {
      for (int r = 0; r < 8; ++r) {
        for (int b = 0; b < 4; ++b) {
          xd[at + 4 * r + b] = a.h.x[at + 8 * r + b];
          xd[at + 32 + 4 * r + b] = a.h.x[at + 8 * r + 4 + b];
        }
      }
    }
    q.h.x = xd.data();
  }
  parallel_for((a.h.N + a.h.rows_per_task - 1) / a.h.rows_per_task, task, &q);
}

}  // namespace

void head(const HeadArgs& a) {
  parallel_for((a.N + a.rows_per_task - 1) / a.rows_per_task, head_task,
               const_cast<HeadArgs*>(&a));
}

void qhead(const QHeadArgs& a) { return a.bits == 4 ? qhead_bits<4>(a) : qhead_bits<8>(a); }

}  // namespace mas::avx2

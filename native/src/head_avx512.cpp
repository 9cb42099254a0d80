// The greedy head on AVX-512 (F, BW, VL, DQ) with VNNI: the int8 screening of a float32 or
// bf16 head's copy, and a quantized head's screening over its own codes (greedy_head.cpp
// drives both, head.inc holds the per-tile logic every ISA shares). Built with the flags of
// kernels_avx512.cpp.
#include <immintrin.h>

#include <vector>

#include "avx512_base.h"
#include "kernels.h"

namespace mas::avx512 {

#include "head.inc"

namespace {

// res[i] = sum of the 16 lanes of acc[i]: reduce()'s transposing tree in integers.
inline void reduce16_epi32(const __m512i* v, int32_t* res) {
  __m512i t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  }
  __m512i u[4];
  for (int j = 0; j < 4; ++j) {
    u[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                            _mm512_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
  }
  const __m512i s01 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i s23 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i r =
      _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_i32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_si512(res, r);
}

// VNNI only here, written as inline assembly: the file's flags do not include VNNI (so the
// compiler puts it nowhere else), and GCC 12 copies and spills the accumulators of the
// intrinsic's tied operand. vpdpbusd adds four unsigned-by-signed byte products into each
// int32 lane of acc, 64 per instruction.
inline void dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

// Rows of x up to which both heads read their rows of W one after another (head_dots_seq,
// qhead_direct_block) rather than in interleaved tiles (head_dots) or transposed blocks
// (qhead_dots): measured best to 12 (qwen3-small's head: int8 7.6 vs 8.6 ms at 12 rows,
// 17.3 vs 13.4 at 32; 4-bit 5.6 vs 7.1 at 12-13, 9.3 vs 7.9 at 16).
constexpr int kFewRows = 12;

// Register tiles of 4 rows of W x MR rows of x: 4 + MR loads per 4 * MR instructions. A
// kHeadTile block of W (16 x Kp bytes, contiguous) stays in L1 while every row of x runs.
// `next`: the next tile's rows (contiguous), prefetched while the first rows of x run, so the
// memory stream overlaps the arithmetic of the rows of x that find this tile in L1.
template <int MR>
void head_dots(const HeadArgs& a, const uint8_t* const* rows, int64_t m0, int32_t* dots,
               const uint8_t* next) {
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = a.x + (m0 + i) * a.Kp;
  for (int sub = 0; sub < kHeadTile / 4; ++sub) {
    const uint8_t* w0 = rows[4 * sub];
    const uint8_t* w1 = rows[4 * sub + 1];
    const uint8_t* w2 = rows[4 * sub + 2];
    const uint8_t* w3 = rows[4 * sub + 3];
    __m512i acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_si512();
    const uint8_t* pf = next == nullptr ? nullptr : next + 4 * sub * a.Kp;
    for (int64_t k = 0; k < a.Kp; k += 64) {
      if (pf != nullptr) {
        for (int r = 0; r < 4; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * a.Kp + k), _MM_HINT_T0);
        }
      }
      const __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
      const __m512i v2 = _mm512_loadu_si512(w2 + k), v3 = _mm512_loadu_si512(w3 + k);
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_loadu_si512(xr[i] + k);
        dpbusd(acc[4 * i], v0, xv);
        dpbusd(acc[4 * i + 1], v1, xv);
        dpbusd(acc[4 * i + 2], v2, xv);
        dpbusd(acc[4 * i + 3], v3, xv);
      }
    }
    alignas(64) int32_t res[16];
    // A copy: acc's address never escapes, so it can stay in registers through the k loop.
    __m512i fin[16];
    for (int j = 0; j < 16; ++j) fin[j] = acc[j];
    reduce16_epi32(fin, res);
    for (int i = 0; i < MR; ++i) {
      for (int r = 0; r < 4; ++r) dots[i * kHeadTile + 4 * sub + r] = res[4 * i + r];
    }
  }
}

// The tile's 16 rows of W one after another (one memory stream, as the quantized direct path
// reads), each row's chunk loaded once for the MR rows of x, the next tile prefetched
// alongside; each row of x's 16 sums meet in one transposing tree. Up to kFewRows rows of x
// (blocks of 4) it beats head_dots' 4 rows of W interleaved (qwen3-small's head at 1 / 8 rows:
// 2.2-2.9 / 4.7-5.3 ms against 3.6-3.7 / 6.4-9.2).
template <int MR>
void head_dots_seq(const HeadArgs& a, const uint8_t* const* rows, int64_t m0, int32_t* dots,
                   const uint8_t* next) {
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = a.x + (m0 + i) * a.Kp;
  __m512i acc[MR][kHeadTile];
  for (int j = 0; j < kHeadTile; ++j) {
    const uint8_t* w = rows[j];
    const uint8_t* pf = next == nullptr ? nullptr : next + j * a.Kp;
    __m512i sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = _mm512_setzero_si512();
    for (int64_t k = 0; k < a.Kp; k += 64) {
      if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w + k);
      for (int i = 0; i < MR; ++i) dpbusd(sum[i], v, _mm512_loadu_si512(xr[i] + k));
    }
    for (int i = 0; i < MR; ++i) acc[i][j] = sum[i];
  }
  for (int i = 0; i < MR; ++i) reduce16_epi32(acc[i], dots + i * kHeadTile);
}

void head_task(void* ctx, int64_t task) {
  const HeadArgs& a = *static_cast<const HeadArgs*>(ctx);
  head_run<4>(a, task, [&a](const uint8_t* const* rows, int64_t m0, int mr, int32_t* out,
                            const uint8_t* next) {
    if (a.M <= kFewRows) {
      switch (mr) {
        case 4: return head_dots_seq<4>(a, rows, m0, out, next);
        case 3: return head_dots_seq<3>(a, rows, m0, out, next);
        case 2: return head_dots_seq<2>(a, rows, m0, out, next);
        default: return head_dots_seq<1>(a, rows, m0, out, next);
      }
    }
    switch (mr) {
      case 4: return head_dots<4>(a, rows, m0, out, next);
      case 3: return head_dots<3>(a, rows, m0, out, next);
      case 2: return head_dots<2>(a, rows, m0, out, next);
      default: return head_dots<1>(a, rows, m0, out, next);
    }
  });
}

// The quantized head: 16 rows per vector, one row per lane, so a group's scale and bias
// apply to 16 rows in one FMA each and no sum crosses lanes. A block's packed words are
// transposed once (16 x 16 dwords per 64-byte step of its rows) into the thread's buffer, the
// 4-bit nibbles split there too; each row of x then reads it from L1 with vpdpbusd taking x's
// four bytes by broadcast from memory.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // lane L: (a0 b0 a1 b1), (a2 b2 a3 b3) of rows 2i, 2i + 1
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], lane L: dword 4L + j of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // r[4L + j]: dword 4L + j of every row
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
    r[j] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + j] = _mm512_shuffle_i32x4(v0, w0, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + j] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + j] = _mm512_shuffle_i32x4(v1, w1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// acc += the four byte products of w (unsigned) and x's four bytes at p, in every lane.
inline void dpbusd_bcast(__m512i& acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
}

// buf: per word d of the block's rows, one vector (8-bit) or two (4-bit: the low nibbles,
// then the high ones) of 16 rows x 4 bytes.
template <int BITS>
void qhead_tile(const QHeadArgs& q, const uint32_t* const* rows, __m512i* buf) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t c = 0; c < q.row_words; c += 16) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows[j] + c);
    transpose16(r);
    for (int t = 0; t < 16; ++t) {
      if (BITS == 4) {
        buf[2 * (c + t)] = _mm512_and_si512(r[t], low);
        buf[2 * (c + t) + 1] = _mm512_and_si512(_mm512_srli_epi16(r[t], 4), low);
      } else {
        buf[c + t] = r[t];
      }
    }
  }
}

template <int MR, int BITS>
void qhead_dots(const QHeadArgs& q, const __m512i* buf, int64_t n0, int64_t m0, float* out) {
  const HeadArgs& a = q.h;
  const int8_t* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = a.x + (m0 + i) * a.Kp;
  const float* xsum = q.xsum + m0 * q.G;
  const float* tab = q.table + (n0 / kHeadTile) * q.G * 32;
  const int64_t words = q.group_size * BITS / 32;  // per group
  vf accf[MR];
  for (int i = 0; i < MR; ++i) accf[i] = vzero();
  for (int64_t g = 0; g < q.G; ++g) {
    __m512i acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t d = g * words; d < (g + 1) * words; ++d) {
      if (BITS == 4) {
        const __m512i lo = buf[2 * d], hi = buf[2 * d + 1];
        for (int i = 0; i < MR; ++i) {
          dpbusd_bcast(acc[i], lo, xr[i] + 8 * d);
          dpbusd_bcast(acc[i], hi, xr[i] + 8 * d + 4);
        }
      } else {
        const __m512i v = buf[d];
        for (int i = 0; i < MR; ++i) dpbusd_bcast(acc[i], v, xr[i] + 4 * d);
      }
    }
    const vf scale = vload(tab + g * 32), bias = vload(tab + g * 32 + 16);
    for (int i = 0; i < MR; ++i) {
      accf[i] = vfma(_mm512_cvtepi32_ps(acc[i]), scale, accf[i]);
      accf[i] = vfma(bias, _mm512_set1_ps(xsum[i * q.G + g]), accf[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    vstore(out + i * kHeadTile, _mm512_mul_ps(accf[i], _mm512_set1_ps(a.xscale[m0 + i])));
  }
}

template <int BITS>
void qhead_task(void* ctx, int64_t task) {
  const QHeadArgs& q = *static_cast<const QHeadArgs*>(ctx);
  // Slot 1 (the dequantized tiles of qmm; never both in one task): 64-byte aligned.
  __m512i* buf = reinterpret_cast<__m512i*>(
      thread_buffer(1, static_cast<size_t>(q.row_words) * (BITS == 4 ? 2 : 1) * 16));
  int64_t base = 0;
  qhead_run<8>(
      q, task,
      [&](int64_t n0, const uint32_t* const* rows) {
        base = n0;
        qhead_tile<BITS>(q, rows, buf);
      },
      [&](int64_t m0, int mr, float* out) {
        switch (mr) {
          case 8: return qhead_dots<8, BITS>(q, buf, base, m0, out);
          case 7: return qhead_dots<7, BITS>(q, buf, base, m0, out);
          case 6: return qhead_dots<6, BITS>(q, buf, base, m0, out);
          case 5: return qhead_dots<5, BITS>(q, buf, base, m0, out);
          case 4: return qhead_dots<4, BITS>(q, buf, base, m0, out);
          case 3: return qhead_dots<3, BITS>(q, buf, base, m0, out);
          case 2: return qhead_dots<2, BITS>(q, buf, base, m0, out);
          default: return qhead_dots<1, BITS>(q, buf, base, m0, out);
        }
      });
}

// Few rows of x (decode at low concurrency): the codes row by row as they lie, lanes along K.
// Transposing a block costs more than its products when few rows of x read it (the tile path
// above took 3.5 ms on qwen3-small's 4-bit head at one row, against 2.7 for the float
// product). Per 64-byte chunk of a code row: vpdpbusd of its 16 words with each row of x's
// matching bytes (4-bit: the low nibbles, then the high ones), converted and scaled by each
// lane's group (broadcast from the table), summed in float lanes; 16 code rows' lanes meet in
// one transposing tree per row of x. 4-bit: x is laid out once per call (qhead_direct): per
// chunk, the 64 bytes for the low nibbles, then the 64 for the high.
template <int BITS, int GS, int MR>
void qhead_direct_block(const QHeadArgs& q, const uint8_t* const* block, int64_t n0,
                        const int8_t* xd, float* out) {
  const HeadArgs& a = q.h;
  constexpr int kGroupBytes = GS * BITS / 8;
  constexpr int kPerChunk = kGroupBytes >= 64 ? 1 : 64 / kGroupBytes;  // groups in a chunk
  constexpr int kChunks = kGroupBytes >= 64 ? kGroupBytes / 64 : 1;    // chunks in a group
  constexpr int kLanes = kGroupBytes / 4;                              // lanes of a group
  constexpr int kXBytes = BITS == 4 ? 128 : 64;                        // x's per chunk
  const int64_t chunks = q.row_words / 16, row_bytes = q.row_words * 4;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const float* tab = q.table + (n0 / kHeadTile) * q.G * 32;
  // The next block (16 contiguous code rows) streams in while this one runs.
  const uint8_t* next = block[0] + kHeadTile * row_bytes;
  const bool ahead = n0 + 2 * kHeadTile <= a.N;
  vf accs[MR][kHeadTile];
  for (int j = 0; j < kHeadTile; ++j) {
    const uint8_t* w = block[j];
    vf accf[MR];
    for (int i = 0; i < MR; ++i) accf[i] = vzero();
    int64_t g = 0;
    for (int64_t c = 0; c < chunks; g += kPerChunk) {
      __m512i acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
      for (int cc = 0; cc < kChunks; ++cc, ++c) {
        if (ahead) {
          _mm_prefetch(reinterpret_cast<const char*>(next + j * row_bytes + 64 * c),
                       _MM_HINT_T0);
        }
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        if (BITS == 4) {
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int i = 0; i < MR; ++i) {
            const int8_t* xr = xd + i * a.Kp + kXBytes * c;
            dpbusd(acc[i], lo, _mm512_loadu_si512(xr));
            dpbusd(acc[i], hi, _mm512_loadu_si512(xr + 64));
          }
        } else {
          for (int i = 0; i < MR; ++i) {
            dpbusd(acc[i], v, _mm512_loadu_si512(xd + i * a.Kp + kXBytes * c));
          }
        }
      }
      vf scale = _mm512_set1_ps(tab[g * 32 + j]);
      for (int k = 1; k < kPerChunk; ++k) {
        const __mmask16 lanes = static_cast<__mmask16>(((1u << kLanes) - 1u) << (k * kLanes));
        scale = _mm512_mask_mov_ps(scale, lanes, _mm512_set1_ps(tab[(g + k) * 32 + j]));
      }
      for (int i = 0; i < MR; ++i) accf[i] = vfma(_mm512_cvtepi32_ps(acc[i]), scale, accf[i]);
    }
    for (int i = 0; i < MR; ++i) accs[i][j] = accf[i];
  }
  for (int i = 0; i < MR; ++i) {
    alignas(64) float res[kHeadTile];
    reduce(accs[i], kHeadTile, res);
    vf sum = vload(res);
    const float* xsum = q.xsum + i * q.G;
    for (int64_t gg = 0; gg < q.G; ++gg) {
      sum = vfma(vload(tab + gg * 32 + 16), _mm512_set1_ps(xsum[gg]), sum);
    }
    vstore(out + i * kHeadTile, _mm512_mul_ps(sum, _mm512_set1_ps(a.xscale[i])));
  }
}

template <int BITS, int GS>
void qhead_direct_task(void* ctx, int64_t task) {
  const QHeadArgs& q = *static_cast<const QHeadArgs*>(ctx);
  const int8_t* xd = q.h.x;  // laid out by qhead_direct
  const uint8_t* block[kHeadTile];
  int64_t base = 0;
  qhead_run<kFewRows>(
      q, task,
      [&](int64_t n0, const uint32_t* const* rows) {
        base = n0;
        for (int j = 0; j < kHeadTile; ++j) block[j] = reinterpret_cast<const uint8_t*>(rows[j]);
      },
      [&](int64_t, int mr, float* out) {  // one call: every row of x (M <= kFewRows)
        switch (mr) {
          case 12: return qhead_direct_block<BITS, GS, 12>(q, block, base, xd, out);
          case 11: return qhead_direct_block<BITS, GS, 11>(q, block, base, xd, out);
          case 10: return qhead_direct_block<BITS, GS, 10>(q, block, base, xd, out);
          case 9: return qhead_direct_block<BITS, GS, 9>(q, block, base, xd, out);
          case 8: return qhead_direct_block<BITS, GS, 8>(q, block, base, xd, out);
          case 7: return qhead_direct_block<BITS, GS, 7>(q, block, base, xd, out);
          case 6: return qhead_direct_block<BITS, GS, 6>(q, block, base, xd, out);
          case 5: return qhead_direct_block<BITS, GS, 5>(q, block, base, xd, out);
          case 4: return qhead_direct_block<BITS, GS, 4>(q, block, base, xd, out);
          case 3: return qhead_direct_block<BITS, GS, 3>(q, block, base, xd, out);
          case 2: return qhead_direct_block<BITS, GS, 2>(q, block, base, xd, out);
          default: return qhead_direct_block<BITS, GS, 1>(q, block, base, xd, out);
        }
      });
}

template <int BITS>
void qhead_direct(const QHeadArgs& a) {
  void (*task)(void*, int64_t) = a.group_size == 32   ? qhead_direct_task<BITS, 32>
                                 : a.group_size == 64 ? qhead_direct_task<BITS, 64>
                                                      : qhead_direct_task<BITS, 128>;
  QHeadArgs q = a;
  std::vector<int8_t> xd;
  if (BITS == 4) {  // x in the transposed path's order (per word: 4 low-nibble bytes, 4 high),
                    // split: per 128-byte chunk the low nibbles' 64 bytes, then the high ones'
    xd.resize(static_cast<size_t>(a.h.M * a.h.Kp));
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t at = 0; at < a.h.M * a.h.Kp; at += 128) {
      const __m512i lo = _mm512_loadu_si512(a.h.x + at);
      const __m512i hi = _mm512_loadu_si512(a.h.x + at + 64);
      _mm512_storeu_si512(xd.data() + at, _mm512_permutex2var_epi32(lo, even, hi));
      _mm512_storeu_si512(xd.data() + at + 64, _mm512_permutex2var_epi32(lo, odd, hi));
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

void qhead(const QHeadArgs& a) {
  if (a.h.M <= kFewRows) return a.bits == 4 ? qhead_direct<4>(a) : qhead_direct<8>(a);
  parallel_for((a.h.N + a.h.rows_per_task - 1) / a.h.rows_per_task,
               a.bits == 4 ? qhead_task<4> : qhead_task<8>, const_cast<QHeadArgs*>(&a));
}

}  // namespace mas::avx512

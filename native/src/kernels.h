// Plain interface between the MLX glue (ops.cpp) and the per-ISA kernels.
//
// Every kernels_<isa>.cpp is compiled with its own target flags. So that no inline function
// compiled for AVX-512 can be picked by the linker for a caller on another path, the ISA files
// include only this header and <immintrin.h>, and keep everything else in anonymous namespaces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mas {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

// out[M, N] = x[M, K] @ dequantize(w).T, affine layout (mlx): w is uint32 [N, K*bits/32] with
// values packed little end first; value = scale * q + bias per row n and group of K.
struct QmmArgs {
  const float* x;
  const uint32_t* w;
  const void* scales;  // [N, K / group_size], type st
  const void* biases;
  ScaleType st;
  float* out;
  int64_t M, N, K;
  int group_size, bits;
};

// out[M, N] = x[M, K] @ float32(w).T with w bfloat16 [N, K] (raw uint16 bits).
struct Bf16Args {
  const float* x;
  const uint16_t* w;
  float* out;
  int64_t M, N, K;
};

// out[M, N] = x[M, K] @ w.T with w float32 [N, K]: for few rows of x, where a BLAS GEMM is
// far from the bandwidth a [M <= 32, K] x [K, N] product needs (one pass over w).
struct F32Args {
  const float* x;
  const float* w;
  float* out;
  int64_t M, N, K;
};

// out[b, h] = softmax(scale * q[b, h] . K_b[h / group, t]) V_b[h / group, t] over t < lengths[b],
// where row b's token t lives at k[kv_head, pages[b, t / page], t % page] (and v alike): one
// query token per row against the decode batch's page pool [kv_heads, pool pages, page, dim],
// dim a multiple of 16, group = heads / kv_heads <= 64. A contiguous [kv_heads, rows, columns,
// dim] buffer is the pool with page = columns and pages[b] = {b}. q, k, v and out are float32,
// or with bf16 all bfloat16 (raw uint16 bits), rounded where MLX's bf16 attention rounds.
struct AttnArgs {
  const void* q;  // [rows, heads, dim]
  const void* k;
  const void* v;
  const int32_t* pages;  // [rows, max_pages]
  const int32_t* lengths;  // [rows], each <= max_pages * page
  void* out;  // [rows, heads, dim]
  int64_t rows, heads, kv_heads, page, max_pages, pool_pages, dim;
  float scale;
  bool bf16;
};

// The gated delta rule, token by token (gated_delta.inc): per batch row b and value head h
// (key head h / (Hv / Hk)), from state_in, for each token t: S = g S, u = beta (v - S k),
// S = S + u k^T, y = S q. Dk a multiple of 16.
struct DeltaArgs {
  const float* q;         // [B, T, Hk, Dk]
  const float* k;         // [B, T, Hk, Dk]
  const float* v;         // [B, T, Hv, Dv]
  const float* g;         // [B, T, Hv]
  const float* beta;      // [B, T, Hv]
  const float* state_in;  // [B, Hv, Dv, Dk]
  float* y;               // [B, T, Hv, Dv]
  float* state;           // [B, Hv, Dv, Dk], may not alias state_in
  int64_t B, T, Hk, Hv, Dk, Dv;
};

// The causal depthwise convolution of the gated-delta layers (gated_delta.inc): out[b, t, c]
// = sum_j x[b, t + j, c] w[j, c], j < K.
struct ConvArgs {
  const float* x;  // [B, T + K - 1, C]: the K - 1 positions before the chunk, then its T
  const float* w;  // [K, C]
  float* out;      // [B, T, C]
  int64_t B, T, C, K;
};

// SiLU over n floats (activation.inc): out = silu(gate), times x where x is given.
struct ActArgs {
  const void* gate;  // float32, or bfloat16 with bf16
  const void* x;     // nullptr: silu(gate) alone
  void* out;         // may alias gate or x
  int64_t n;
  bool bf16;  // MLX's bf16 silu(gate) [* x] bit for bit (each op's result rounded to bf16)
};

// Softmax of each row of `width` scores (activation.inc). length > 0: causal, rows are
// queries of a chunk of `length` (row r is query r % length, at key position width - length +
// r % length) and keys after the query's position come out 0.
struct SoftmaxArgs {
  const void* scores;  // [rows, width], float32, or bfloat16 with bf16
  void* out;           // [rows, width] of the same type, may alias scores
  int64_t rows, width, length;
  bool bf16;  // MLX's bf16 softmax (precise) bit for bit: its exp, its order of sums
};

// One draw per row from softmax(x) of each row of `width` float32 logits (sampling.inc): the
// first index whose running sum of exp(x - max) over the kept values passes u * their total.
// Kept: x >= floor[row] (all where floor is null); -inf is never drawn.
struct CatArgs {
  const float* x;      // [rows, width]
  const float* u;      // [rows], uniform in [0, 1)
  const float* floor;  // [rows] or null
  uint32_t* out;       // [rows]
  int64_t rows, width;
};

// mx.argmax over each row of `width` float32 values (sampling.inc): the first NaN if any,
// else the first maximum.
struct ArgmaxArgs {
  const float* x;  // [rows, width]
  uint32_t* out;   // [rows]
  int64_t rows, width;
};

// Each row's top_k / top_p / min_p threshold (sampling.inc): out[row] such that x >= it is the
// set filters.apply_filters keeps. top_k <= 0 or >= width, top_p >= 1, log_min_p = -inf: off.
struct FloorArgs {
  const float* x;          // [rows, width]
  const int32_t* top_k;    // [rows]
  const float* top_p;      // [rows]
  const float* log_min_p;  // [rows]
  float* out;              // [rows]
  int64_t rows, width;
};

// The greedy head's first pass (greedy_head.cpp): int8 dot products of x's and W's rows
// with error bounds, keeping the vocabulary rows that can still be the argmax of x @ W.T.
// Per (task, row of x) state: `lo`, the best lower bound seen so far (by any task: they
// share it through `shared_lo`); the rows whose upper bound reached `lo` when they were seen
// (a superset of those at or above the final maximum of the lower bounds). When kHeadCap
// entries do not fit them, `overflow` is set and the caller scans the task's rows exactly.
constexpr int kHeadCap = 64;
struct HeadTask {
  float lo;
  int32_t count, overflow;
  int32_t idx[kHeadCap];
  float up[kHeadCap];
};
struct HeadArgs {
  const int8_t* x;       // [M, Kp] x rows quantized: x ~ xscale[m] * x[m], zero past K
  const uint8_t* w;      // [N, Kp] W rows quantized, + 128: W ~ wscale[n] * (w[n] - 128)
  const float* wscale;   // [N]
  const float* wnorm;    // [N] ||W[n]||_2
  const float* werr;     // [N] ||W[n] - wscale[n] * (w[n] - 128)||_2
  const int32_t* xoff;   // [M] 128 * sum of x[m]: the +128's share of a dot product
  const float* xscale;   // [M]
  const float* alpha;    // [M] with beta: a row's bound is alpha[m] wnorm[n] + beta[m] werr[n]
  const float* beta;     // [M]
  HeadTask* tasks;       // [ntasks, M], ntasks = ceil(N / rows_per_task)
  uint32_t* shared_lo;   // [M] float32 bits: the best lower bound any task has seen
  int64_t M, N, Kp, rows_per_task;  // Kp: a multiple of 64; rows_per_task: of 16
  // [M, words] or null: bit n % 32 of word n / 32 of row m set where row n may win for x[m]
  // (a constrained row's grammar); the others are never kept nor raise lo.
  const uint32_t* allowed;
  int64_t words;
};

// The greedy head over a quantized head's own codes (mlx's affine layout, 4 or 8 bits): no
// copy of W, so no error from one. h.x holds x[m] quantized, in the order the packed words hold
// their values (4-bit: each run of 8 as 0, 2, 4, 6, 1, 3, 5, 7, the low then the high nibbles
// of a word's four bytes); h.w, h.wscale and h.xoff are unused; h.werr[n] bounds the float32
// rounding of the products below. approx = xscale * sum over groups g of
// (scale[n, g] * (x[m] . q[n, g]) + bias[n, g] * xsum[m, g]), with x[m] . q in integers.
struct QHeadArgs {
  HeadArgs h;              // h.Kp = K: a multiple of 128 (4-bit) or 64 (8-bit)
  const uint32_t* codes;   // [N, row_words]: the model's packed weight
  const float* table;      // [ceil(N / 16), G, 2, 16]: 16 rows' scales, then their biases
  const float* xsum;       // [M, G]: the sum of h.x[m] over each group
  int64_t row_words, G;
  int bits, group_size;    // 4 or 8; 32, 64 or 128
  // The table as float16, or null: AVX2 screens with it (half the table's bytes; the bound's
  // werr covers its rounding, greedy_head.py), the other paths read `table`.
  const uint16_t* screen = nullptr;
};

namespace scalar {
void qhead(const QHeadArgs& a);
void gated_delta(const DeltaArgs& a);
void silu_values(const ActArgs& a);
void conv_values(const ConvArgs& a);
void softmax_rows(const SoftmaxArgs& a);
void categorical_rows(const CatArgs& a);
void argmax_rows(const ArgmaxArgs& a);
void filter_floor_rows(const FloorArgs& a);
void qmm(const QmmArgs& a);
void bf16mm(const Bf16Args& a);
void f32mm(const F32Args& a);
void attention(const AttnArgs& a);
void head(const HeadArgs& a);
}  // namespace scalar
namespace avx2 {
void gated_delta(const DeltaArgs& a);
void silu_values(const ActArgs& a);
void conv_values(const ConvArgs& a);
void softmax_rows(const SoftmaxArgs& a);
void categorical_rows(const CatArgs& a);
void argmax_rows(const ArgmaxArgs& a);
void filter_floor_rows(const FloorArgs& a);
void qmm(const QmmArgs& a);
void bf16mm(const Bf16Args& a);
void f32mm(const F32Args& a);
void attention(const AttnArgs& a);
void head(const HeadArgs& a);  // head_avx2.cpp, like qhead
void qhead(const QHeadArgs& a);
}  // namespace avx2
namespace avx512 {
void qhead(const QHeadArgs& a);
void gated_delta(const DeltaArgs& a);
void silu_values(const ActArgs& a);
void conv_values(const ConvArgs& a);
void softmax_rows(const SoftmaxArgs& a);
void categorical_rows(const CatArgs& a);
void argmax_rows(const ArgmaxArgs& a);
void filter_floor_rows(const FloorArgs& a);
void qmm(const QmmArgs& a);
void bf16mm(const Bf16Args& a);
void f32mm(const F32Args& a);
void attention(const AttnArgs& a);
void head(const HeadArgs& a);  // needs AVX-512 VNNI (dispatch.cpp checks)
}  // namespace avx512

// dispatch.cpp: the path in use, chosen from the CPU at load time.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };
Isa current_isa();
bool cpu_has(Isa isa);
void select_isa(Isa isa);  // caller checks cpu_has first
const char* isa_name(Isa isa);
void qmm(const QmmArgs& a);
void bf16mm(const Bf16Args& a);
void f32mm(const F32Args& a);
void attention(const AttnArgs& a);
void gated_delta(const DeltaArgs& a);
void silu_values(const ActArgs& a);
void conv_values(const ConvArgs& a);
void softmax_rows(const SoftmaxArgs& a);
void categorical_rows(const CatArgs& a);
void argmax_rows(const ArgmaxArgs& a);
void filter_floor_rows(const FloorArgs& a);
void head(const HeadArgs& a);
void qhead(const QHeadArgs& a);
// Whether qhead has a vectorized path on this CPU (AVX2, or AVX-512 with VNNI): elsewhere it
// is scalar code, right but slower than the quantized head's own products.
bool qhead_fast();
// Whether qhead on the path in use screens with QHeadArgs::screen, the float16 table (AVX2's);
// the others read the float32 one.
bool qhead_half_table();
// The levels x is quantized to for head() on the path in use: 127, or 63 where the int8
// products go through vpmaddubsw (AVX2), whose 16-bit pair sums would saturate at 127.
int head_x_levels();

// threads.cpp: one job at a time over a small pool; the calling thread takes part.
// Runs fn(ctx, t) for t in [0, ntasks), in any order, on up to num_threads() threads.
void parallel_for(int64_t ntasks, void (*fn)(void* ctx, int64_t task), void* ctx);
int num_threads();
void set_num_threads(int n);  // n >= 1
int default_num_threads();
void set_spin_loops(int n);  // idle workers' polling before sleeping (benchmarks)
// The CPUs the pool's workers run on, now and once made; empty: where their creator may.
void set_worker_cpus(const std::vector<int>& cpus);

// A 64-byte aligned buffer of at least `floats` floats owned by the calling thread; `slot`
// picks one of a few independent buffers (0: prepared activations, 1: dequantized tiles, 2:
// attention weights).
// Valid until the same thread asks for the same slot again, or calls trim_thread_buffer(slot).
float* thread_buffer(int slot, size_t floats);
// Frees the slot's buffer if it holds more than `keep_floats` (prefill-sized activations are
// not kept for the life of the thread).
void trim_thread_buffer(int slot, size_t keep_floats);

}  // namespace mas

// The greedy head: argmax over the vocabulary of x @ W.T, without computing x @ W.T.
//
// Why: in decode, the LM head of a small model with a large vocabulary is most of a step
// (qwen3-small: 151,936 x 512 float32, 311 MB read per step, 2.5 GFLOP at 16 rows, more than
// the six layers together), and a greedy row wants one number out of it. So:
// 1. x's rows are quantized to integers (x ~ xs * xq), W's rows were at load (W ~ ws * wq,
//    int8); all products go through int8 dot products (AVX-512 VNNI: 64 per instruction,
//    over a quarter of the float32 bytes).
// 2. Each approximation a = xs * ws * (xq . wq) comes with a bound on its error:
//        x . W - a = (x - xs xq) . W + xs xq . (W - ws wq)
//        |x . W - a| <= ||x - xs xq|| ||W|| + ||xs xq|| ||W - ws wq||      (Cauchy-Schwarz)
//    plus float rounding (1e-5 of ||x|| ||W||, hundreds of times what it can be). With the
//    best lower bound lo = max(a - bound), the winner's upper bound a + bound is >= lo.
// 3. The rows whose upper bound reaches lo (2-9 on qwen3-small) are multiplied exactly
//    (float64 sums of the float32 products) and the largest wins, the lowest index on ties.
// The result is the argmax of the exact products: the same token as mx.argmax of the float32
// logits, up to ties within their rounding (as between any two BLAS orderings). Rows that do
// not narrow down (the per-task candidate lists overflow, non-finite x) are scanned whole.
// With bf16_logits (a bf16 model: its logits are the float32 sums rounded to bf16, where ties
// are common and the lowest index wins), each bound also covers that rounding (half a bf16
// ulp, at most 2^-8 of the value), and the exact products are rounded the same way before
// they are compared.
// A quantized head (4 or 8 bits, mlx's affine layout: greedy_head_quantized) is screened over
// its own packed codes instead of a copy: W has no error of its own there, so each bound is
// x's quantization (||x - xs xq|| ||W||) plus the float32 rounding of the per-group sums
// (QHeadArgs, kernels.h), and the exact products dequantize the candidates' codes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace mas {
namespace {

constexpr int64_t kRowsPerTask = 1024;  // vocabulary rows per task (a multiple of kHeadTile)
constexpr double kSlack = 1e-5;  // float rounding of a and its bound, relative to ||x|| ||W||

// x . w[n] with float64 sums: every float32 (or bf16) product is exact in float64.
template <class T>
double exact_dot(const float* x, const T* w, int64_t K) {
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(x[k]) * static_cast<float>(w[k]);
  return sum;
}

// The value a float32 sum has once rounded to a bf16 logit: MLX's own conversion (round to
// nearest even), so the kernel rounds exactly as astype(mx.bfloat16) does.
double bf16_round(double v) {
  return static_cast<float>(mx::bfloat16_t(static_cast<float>(v)));
}

struct Best {
  double value = -HUGE_VAL;
  int32_t index = -1;
  void offer(double v, int32_t n) {
    // NaN products never win; among equal values the lowest index does (mx.argmax's rule).
    if (v > value || (v == value && (index < 0 || n < index))) {
      value = v;
      index = n;
    }
  }
};

// bit n of a row's mask, or true without one.
inline bool allows(const uint32_t* mask, int64_t n) {
  return mask == nullptr || ((mask[n >> 5] >> (n & 31)) & 1u);
}

// A dense head's rows: float32 or bfloat16 [N, K] and their int8 copy.
template <class T>
struct DenseRows {
  const T* w;
  const uint8_t* wq;
  int64_t K, Kp;
  double dot(const float* x, int64_t n) const { return exact_dot(x, w + n * K, K); }
  int64_t x_at(int64_t k) const { return k; }
  int64_t groups() const { return 0; }
  void screen(const HeadArgs& a, const float*) const {
    HeadArgs b = a;
    b.w = wq;
    head(b);
  }
};

// A quantized head's rows, from the model's own packed words (QHeadArgs): w = scale * q + bias.
struct QuantRows {
  const uint32_t* codes;
  const float* table;
  int64_t K, G, row_words;
  int bits, group_size;
  const uint16_t* table16;  // the table as float16 (AVX2's screening), or null
  double dot(const float* x, int64_t n) const {
    const uint32_t* row = codes + n * row_words;
    const float* tab = table + (n / 16) * G * 32 + n % 16;
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / group_size;
      const double q = (row[k / per_word] >> (bits * (k % per_word))) & mask;
      sum += static_cast<double>(x[k]) * (double(tab[g * 32]) * q + double(tab[g * 32 + 16]));
    }
    return sum;
  }
  // Where x's value k sits for the kernels: 4-bit runs of 8 as 0, 2, 4, 6, 1, 3, 5, 7.
  int64_t x_at(int64_t k) const {
    if (bits != 4) return k;
    const int64_t e = k % 8;
    return k - e + (e & 1) * 4 + (e >> 1);
  }
  int64_t groups() const { return G; }
  void screen(const HeadArgs& a, const float* xsum) const {
    qhead(QHeadArgs{a, codes, table, xsum, row_words, G, bits, group_size, table16});
  }
};

template <class Rows>
struct Scan {
  const float* x;
  const Rows& rows;
  int64_t N;
  bool bf16_logits;
  const uint32_t* mask;
  std::vector<Best> parts;
};

constexpr int64_t kScanRows = 4096;

template <class Rows>
void scan_task(void* ctx, int64_t task) {
  auto& s = *static_cast<Scan<Rows>*>(ctx);
  const int64_t end = std::min(s.N, (task + 1) * kScanRows);
  Best b;
  for (int64_t n = task * kScanRows; n < end; ++n) {
    if (!allows(s.mask, n)) continue;
    const double v = s.rows.dot(s.x, n);
    b.offer(s.bf16_logits ? bf16_round(v) : v, static_cast<int32_t>(n));
  }
  s.parts[task] = b;
}

// Every row of w, exactly: for the rows of x whose candidates did not narrow down.
template <class Rows>
int32_t full_scan(const float* x, const Rows& rows, int64_t N, bool bf16_logits,
                  const uint32_t* mask) {
  Scan<Rows> s{x, rows, N, bf16_logits, mask,
               std::vector<Best>((N + kScanRows - 1) / kScanRows)};
  parallel_for(static_cast<int64_t>(s.parts.size()), scan_task<Rows>, &s);
  Best b;
  for (const Best& p : s.parts) {
    if (p.index >= 0) b.offer(p.value, p.index);
  }
  return b.index < 0 ? 0 : b.index;
}

// Kp: the length of x's quantized rows (a multiple of 64, zero past K).
template <class Rows>
void run(const float* x, const Rows& rows, const float* stats, int32_t* out, int64_t M,
         int64_t N, int64_t K, int64_t Kp, int64_t Np, bool bf16_logits,
         const uint32_t* allowed, int64_t words) {
  // A logit r rounded to bf16 is within 2^-8 |t| of t, and |t| <= ||x|| ||W[n]||.
  const double rounding = bf16_logits ? 1.0 / 256 : 0.0;
  const auto value = [bf16_logits](double v) { return bf16_logits ? bf16_round(v) : v; };
  const int levels = head_x_levels();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<HeadTask> tasks;
  xq.assign(M * Kp, 0);
  const int64_t G = rows.groups();
  std::vector<float> xsum(M * G, 0.0f);  // quantized heads: x's sums per group
  std::vector<int32_t> xoff(M);
  std::vector<float> xscale(M), alpha(M), beta(M);
  std::vector<char> scan(M, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    double maxabs = 0.0, nx2 = 0.0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(xr[k]);
      maxabs = std::max(maxabs, static_cast<double>(std::fabs(xr[k])));
      nx2 += static_cast<double>(xr[k]) * xr[k];
    }
    if (!finite || maxabs == 0.0) {  // all-zero x: every product is 0, scanned like the rest
      scan[m] = 1;
      continue;
    }
    const float xs = static_cast<float>(maxabs / levels);
    double ex2 = 0.0, nq2 = 0.0;
    int64_t sum = 0;
    int8_t* q = xq.data() + m * Kp;
    for (int64_t k = 0; k < K; ++k) {
      const double v = std::clamp(std::nearbyint(static_cast<double>(xr[k]) / xs),
                                  -double(levels), double(levels));
      q[rows.x_at(k)] = static_cast<int8_t>(v);
      sum += static_cast<int64_t>(v);
      if (G) xsum[m * G + k / (K / G)] += static_cast<float>(v);
      const double back = static_cast<double>(xs) * v;
      ex2 += (xr[k] - back) * (xr[k] - back);
      nq2 += back * back;
    }
    const double nx = std::sqrt(nx2), ex = std::sqrt(ex2), nq = std::sqrt(nq2);
    xoff[m] = static_cast<int32_t>(128 * sum);
    xscale[m] = xs;
    // Rounded up to float32 (the bound only grows).
    alpha[m] = std::nextafter(
        static_cast<float>(((ex + kSlack * (nx + nq)) * (1 + rounding) + rounding * nx) *
                           (1 + kSlack)),
        HUGE_VALF);
    beta[m] = std::nextafter(static_cast<float>(nq * (1 + rounding) * (1 + kSlack)), HUGE_VALF);
  }
  const int64_t ntasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  tasks.resize(ntasks * M);
  const float unset = -HUGE_VALF;
  uint32_t unset_bits;
  std::memcpy(&unset_bits, &unset, sizeof unset_bits);
  std::vector<uint32_t> shared_lo(M, unset_bits);
  HeadArgs a{xq.data(), nullptr, stats, stats + Np, stats + 2 * Np, xoff.data(),
             xscale.data(), alpha.data(), beta.data(), tasks.data(), shared_lo.data(), M, N, Kp,
             kRowsPerTask, allowed, words};
  rows.screen(a, xsum.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    const uint32_t* mask = allowed ? allowed + m * words : nullptr;
    if (scan[m]) {
      out[m] = full_scan(xr, rows, N, bf16_logits, mask);
      continue;
    }
    float lo = -HUGE_VALF;
    for (int64_t t = 0; t < ntasks; ++t) lo = std::max(lo, tasks[t * M + m].lo);
    Best b;
    for (int64_t t = 0; t < ntasks; ++t) {
      const HeadTask& ts = tasks[t * M + m];
      if (ts.overflow) {  // its kept rows are not all of its candidates: all of its rows
        const int64_t end = std::min(N, (t + 1) * kRowsPerTask);
        for (int64_t n = t * kRowsPerTask; n < end; ++n) {
          if (!allows(mask, n)) continue;
          b.offer(value(rows.dot(xr, n)), static_cast<int32_t>(n));
        }
        continue;
      }
      for (int32_t i = 0; i < ts.count; ++i) {
        if (ts.up[i] >= lo) b.offer(value(rows.dot(xr, ts.idx[i])), ts.idx[i]);
      }
    }
    out[m] = b.index < 0 ? full_scan(xr, rows, N, bf16_logits, mask) : b.index;
  }
}

// What both heads check: the stats, K, the masks.
template <class Fail>
void check_shared(const mx::array& x, int64_t N, int64_t K, const mx::array& stats,
                  const std::optional<mx::array>& allowed, const Fail& fail) {
  if (stats.ndim() != 2 || stats.dtype() != mx::float32 || stats.shape(0) != 3 ||
      stats.shape(1) % 16 != 0 || stats.shape(1) < N) {
    fail("stats must be float32 [3, Np], Np >= N a multiple of 16");
  }
  if (K > (1 << 16)) fail("K above 65,536 would overflow the int32 products");
  if (allowed && (allowed->ndim() != 2 || allowed->dtype() != mx::uint32 ||
                  allowed->shape(0) != x.shape(0) || allowed->shape(1) < (N + 31) / 32)) {
    fail("allowed must be uint32 [M, words], words >= ceil(N / 32), got " +
         shape_str(allowed->shape()));
  }
}

}  // namespace

mx::array greedy_head(const mx::array& x, const mx::array& w, const mx::array& wq,
                      const mx::array& stats, bool bf16_logits,
                      const std::optional<mx::array>& allowed, mx::StreamOrDevice s) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("greedy_head: " + why + " (x " + shape_str(x.shape()) + ", w " +
                                shape_str(w.shape()) + ", wq " + shape_str(wq.shape()) +
                                ", stats " + shape_str(stats.shape()) + ")");
  };
  if (x.ndim() != 2 || x.dtype() != mx::float32) fail("x must be float32 [M, K]");
  if (w.ndim() != 2 || w.shape(1) != x.shape(1) ||
      (w.dtype() != mx::float32 && w.dtype() != mx::bfloat16)) {
    fail("w must be float32 or bfloat16 [N, K]");
  }
  const int64_t N = w.shape(0), K = w.shape(1);
  if (wq.ndim() != 2 || wq.dtype() != mx::uint8 || wq.shape(0) != N || wq.shape(1) % 64 != 0 ||
      wq.shape(1) < K) {
    fail("wq must be uint8 [N, Kp], Kp >= K a multiple of 64");
  }
  check_shared(x, N, K, stats, allowed, fail);
  mx::Stream stream = cpu_stream(s, "greedy_head");
  std::vector<mx::array> inputs{x, w, wq, stats};
  if (allowed) inputs.push_back(*allowed);
  return mx::array({x.shape(0)}, mx::int32, std::make_shared<GreedyHead>(stream, bf16_logits),
                   std::move(inputs));
}

void GreedyHead::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const mx::array x = row_contiguous(inputs[0], enc), w = row_contiguous(inputs[1], enc);
  const mx::array wq = row_contiguous(inputs[2], enc), st = row_contiguous(inputs[3], enc);
  for (const auto& a : {x, w, wq, st}) enc.set_input_array(a);
  const bool masked = inputs.size() > 4;
  const mx::array mask = masked ? row_contiguous(inputs[4], enc) : inputs[0];
  if (masked) enc.set_input_array(mask);
  const int64_t words = masked ? mask.shape(1) : 0;
  enc.set_output_array(out);
  const int64_t M = x.shape(0), N = w.shape(0), K = w.shape(1), Kp = wq.shape(1);
  const int64_t Np = st.shape(1);
  const bool bf16 = w.dtype() == mx::bfloat16;
  enc.dispatch([xp = x.data<float>(), wf = bf16 ? nullptr : w.data<float>(),
                wb = bf16 ? w.data<mx::bfloat16_t>() : nullptr, qp = wq.data<uint8_t>(),
                sp = st.data<float>(), op = out.data<int32_t>(), M, N, K, Kp, Np,
                round = bf16_logits_, ap = masked ? mask.data<uint32_t>() : nullptr, words]() {
    if (M == 0) return;
    if (wf != nullptr) {
      run(xp, DenseRows<float>{wf, qp, K, Kp}, sp, op, M, N, K, Kp, Np, round, ap, words);
    } else {
      run(xp, DenseRows<mx::bfloat16_t>{wb, qp, K, Kp}, sp, op, M, N, K, Kp, Np, round, ap,
          words);
    }
  });
}

void GreedyHead::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.greedy_head has no GPU kernel: use mx.argmax(x @ w.T)");
}

mx::array greedy_head_quantized(const mx::array& x, const mx::array& codes,
                                const mx::array& table, const mx::array& stats, int group_size,
                                int bits, bool bf16_logits,
                                const std::optional<mx::array>& allowed,
                                const std::optional<mx::array>& screen,
                                mx::StreamOrDevice s) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("greedy_head_quantized: " + why + " (x " +
                                shape_str(x.shape()) + ", codes " + shape_str(codes.shape()) +
                                ", table " + shape_str(table.shape()) + ", stats " +
                                shape_str(stats.shape()) + ", group_size " +
                                std::to_string(group_size) + ", bits " + std::to_string(bits) +
                                ")");
  };
  if (x.ndim() != 2 || x.dtype() != mx::float32) fail("x must be float32 [M, K]");
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128");
  }
  const int64_t K = x.shape(1);
  if (K % (bits == 4 ? 128 : 64) != 0 || K % group_size != 0) {
    fail("K must be a multiple of the group size and of " + std::to_string(bits == 4 ? 128 : 64));
  }
  if (codes.ndim() != 2 || codes.dtype() != mx::uint32 || codes.shape(1) * 32 != K * bits) {
    fail("codes must be uint32 [N, K * bits / 32]");
  }
  const int64_t N = codes.shape(0), G = K / group_size;
  if (table.ndim() != 4 || table.dtype() != mx::float32 || table.shape(0) != (N + 15) / 16 ||
      table.shape(1) != G || table.shape(2) != 2 || table.shape(3) != 16) {
    fail("table must be float32 [ceil(N / 16), K / group_size, 2, 16]");
  }
  if (screen && (screen->dtype() != mx::float16 || screen->shape() != table.shape())) {
    fail("screen must be float16 of the table's shape, not " + shape_str(screen->shape()));
  }
  check_shared(x, N, K, stats, allowed, fail);
  mx::Stream stream = cpu_stream(s, "greedy_head_quantized");
  std::vector<mx::array> inputs{x, codes, table, stats};
  if (screen) inputs.push_back(*screen);
  if (allowed) inputs.push_back(*allowed);
  return mx::array({x.shape(0)}, mx::int32,
                   std::make_shared<GreedyHeadQuantized>(stream, bf16_logits, group_size, bits,
                                                         screen.has_value()),
                   std::move(inputs));
}

void GreedyHeadQuantized::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const mx::array x = row_contiguous(inputs[0], enc), codes = row_contiguous(inputs[1], enc);
  const mx::array table = row_contiguous(inputs[2], enc), st = row_contiguous(inputs[3], enc);
  for (const auto& a : {x, codes, table, st}) enc.set_input_array(a);
  const mx::array screen = screen_ ? row_contiguous(inputs[4], enc) : inputs[0];
  if (screen_) enc.set_input_array(screen);
  const size_t at_mask = screen_ ? 5 : 4;
  const bool masked = inputs.size() > at_mask;
  const mx::array mask = masked ? row_contiguous(inputs[at_mask], enc) : inputs[0];
  if (masked) enc.set_input_array(mask);
  const int64_t words = masked ? mask.shape(1) : 0;
  enc.set_output_array(out);
  const int64_t M = x.shape(0), N = codes.shape(0), K = x.shape(1), Np = st.shape(1);
  const QuantRows rows{codes.data<uint32_t>(), table.data<float>(), K, K / group_size_,
                       codes.shape(1), bits_, group_size_,
                       screen_ ? screen.data<uint16_t>() : nullptr};
  enc.dispatch([xp = x.data<float>(), rows, sp = st.data<float>(), op = out.data<int32_t>(), M,
                N, K, Np, round = bf16_logits_, ap = masked ? mask.data<uint32_t>() : nullptr,
                words]() {
    if (M == 0) return;
    run(xp, rows, sp, op, M, N, K, K, Np, round, ap, words);
  });
}

void GreedyHeadQuantized::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "mas_kernels.greedy_head_quantized has no GPU kernel: use the quantized head's logits");
}

}  // namespace mas

// The MLX operations: lazy graph nodes whose CPU evaluation runs our kernels.
#pragma once

#include <optional>

#include "kernels.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mas {

namespace mx = mlx::core;

// Glue the ops share (ops.cpp): a shape as "(2, 3)", for messages; the stream, refused unless
// it is the CPU's (`op` names the function in the message).
std::string shape_str(const mx::Shape& s);
mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op);

// `a` itself when row-contiguous, else a row-major copy made on the stream (in order, before
// the kernel that reads it) and kept alive by the encoder until that kernel has run.
mx::array row_contiguous(const mx::array& a, mlx::core::cpu::CommandEncoder& enc);
// What a primitive's eval_cpu does first: its outputs allocated, its inputs made row-contiguous,
// both registered with the encoder. Returns the row-contiguous inputs, in order.
std::vector<mx::array> cpu_io(mlx::core::cpu::CommandEncoder& enc,
                              const std::vector<mx::array>& inputs,
                              std::vector<mx::array> outputs);

// affine_qmm's argument checks (ValueError text prefixed by `op`), and the kernels' name of a
// scales dtype (float32, float16, else bfloat16).
void check_affine_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                      const mx::array& biases, int group_size, int bits, const std::string& op);
// The weights' part of it, for x [..., K] (messages prefixed by `op`; `input` names what K
// came from in them, else "K = ...").
void check_affine_weights(int64_t K, const mx::array& w, const mx::array& scales,
                          const mx::array& biases, int group_size, int bits,
                          const std::string& op, const std::string& input = "");
ScaleType scale_type(mx::Dtype t);
// The shape of x [..., K] times w [N, ...].T: x's with its last dimension N.
mx::Shape out_shape(const mx::array& x, const mx::array& w);
// The kernels' arguments for out [M, N] = x [M, K] @ dequantize(w, scales, biases).T, from the
// row-contiguous arrays (w's N its rows).
QmmArgs qmm_args(const float* x, int64_t M, int64_t K, const mx::array& w, const mx::array& scales,
                 const mx::array& biases, int group_size, int bits, float* out);

// x [..., K] float32 @ dequantize(w, scales, biases).T -> [..., N] float32 (mlx affine mode).
mx::array affine_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s = {});

// x [..., K] float32 @ w.T with w bfloat16 [N, K] -> [..., N] float32.
mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// x [..., K] float32 @ w.T with w float32 [N, K] -> [..., N] float32 (for few rows of x).
mx::array f32_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// Decode attention over the runner's decode batch: q [rows, heads, 1, dim] float32 or bfloat16
// (one token per row), k and v the batch's page pool [kv_heads, pool pages, page, dim] (q's type), pages
// [rows, max_pages] int32 (row b's token t is at k[:, pages[b, t / page], t % page]), lengths
// [rows] int32 (row b attends to its tokens 0 .. lengths[b]-1) -> [rows, heads, 1, dim].
mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& pages, const mx::array& lengths, float scale,
                           mx::StreamOrDevice s = {});
// decode_attention's argument checks (messages prefixed by `op`); the kernel's arguments from
// the row-contiguous arrays; the check, inside the task, that every row reads only its pages.
void check_decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                            const mx::array& pages, const mx::array& lengths,
                            const std::string& op);
AttnArgs attn_args(const mx::array& q, const mx::array& k, const mx::array& v,
                   const mx::array& pages, const mx::array& lengths, void* out, float scale);
void check_attention_reads(const AttnArgs& args, const char* op);

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
};

class AffineQmm : public mx::UnaryPrimitive {
 public:
  AffineQmm(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasAffineQmm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

// x @ w.T for a dense weight, bfloat16 or float32 (the kernel follows w's dtype).
class DenseMatmul : public mx::UnaryPrimitive {
 public:
  explicit DenseMatmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasDenseMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// weight * x / sqrt(mean(x^2) + eps) over the last axis; x and weight float32 (layer_ops.cpp).
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// Rotary position embedding of x [batch, heads, tokens, dim] float32: token t of row b at
// position offsets[b] + t (offsets int32 [1] or [batch]), its first `dims` features rotated in
// pairs (i, i + dims/2), or (2i, 2i + 1) when traditional, by position * scale / base^(2i/dims).
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offsets, mx::StreamOrDevice s = {});

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

// The gated delta rule over T tokens (gated_delta.cpp), all float32: q, k [B, T, Hk, Dk], v
// [B, T, Hv, Dv], g and beta [B, T, Hv] (scalar gates), state [B, Hv, Dv, Dk] -> y [B, T, Hv,
// Dv] and the state after the last token: mlx-lm's gated_delta_ops for an unmasked input.
std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const mx::array& g, const mx::array& beta,
                                   const mx::array& state, mx::StreamOrDevice s = {});

// A decode step's writes into one page pool (kv_write.cpp): pool [kv_heads, pages, page, dim],
// index int32 [rows x kv_heads] the slot of each new row in the pool seen flat as [kv_heads x
// pages x page, dim], rows [rows, kv_heads, 1, dim] in the pool's type -> the pool with row j
// of rows (seen as [rows x kv_heads, dim]) at slot index[j], written in place when the pool can
// be donated, or with in_place wherever it is row-contiguous: for a pool whose owner queues
// every read of its old contents before this write, on the same stream (the runner's decode
// pools, read by the step before, which may still be queued), so nobody sees the old contents
// change. kv_write_copies: how many pools had to be copied since the module loaded.
mx::array kv_write(const mx::array& pool, const mx::array& index, const mx::array& rows,
                   bool in_place = false, mx::StreamOrDevice s = {});
int64_t kv_write_copies();

class KvWrite : public mx::UnaryPrimitive {
 public:
  KvWrite(mx::Stream stream, bool in_place) : mx::UnaryPrimitive(stream), in_place_(in_place) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return in_place_ == static_cast<const KvWrite&>(other).in_place_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  bool in_place_;
};

// Rows ids of a quantized table, dequantized (quantized_rows.cpp): w uint32 [vocab, K * bits /
// 32] in mlx's affine layout (bits 4 or 8), scales and biases [vocab, K / group_size] (both
// float32 or both bfloat16), ids int32 [n] -> [n, K], mx.dequantize(w[ids], scales[ids],
// biases[ids]) bit for bit for ids in [0, vocab) (others give zero rows): in float32 with
// `float32` (bf16 scales widened exactly), else in the scales' type.
mx::array quantized_rows(const mx::array& w, const mx::array& scales, const mx::array& biases,
                         const mx::array& ids, int group_size, int bits, bool float32,
                         mx::StreamOrDevice s = {});

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  QuantizedRows(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasQuantizedRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[3].shape(0), inputs[0].shape(1) * (32 / bits_)}};
  }

 private:
  int group_, bits_;
};

// rms_norm of each head of x [rows, 1, heads x dim] (weight [dim]) then rope with offsets, as
// one node (layer_ops.cpp): rope(rms_norm(x.reshape(rows, heads, 1, dim))) bit for bit.
mx::array norm_rope(const mx::array& x, const mx::array& weight, float eps, int heads, int dims,
                    bool traditional, float base, float scale, const mx::array& offsets,
                    mx::StreamOrDevice s = {});

// The norm and RoPE's checks and float32 passes (layer_ops.cpp), for the fused decode layer:
// rms_rows_f32 may write over x; rope_rows_f32 rotates one token per row, [rows, heads, dim].
void check_norm(const mx::array& x, const mx::array& weight, int dim, const std::string& op);
void check_rope(int dims, int dim, const mx::array& offsets, int rows, const std::string& op,
                const char* rows_name);
void rms_rows_f32(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps);
void rope_rows_f32(const float* x, const int32_t* offsets, float* out, int64_t rows,
                   int64_t heads, int64_t dim, int64_t per_row, int dims, bool traditional,
                   float base, float scale);

class NormRope : public mx::UnaryPrimitive {
 public:
  NormRope(mx::Stream stream, float eps, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream), eps_(eps), dims_(dims), traditional_(traditional),
        base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasNormRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
  int dims_;
  bool traditional_;
  float base_, scale_;
};

// Products sharing x (fused_products.cpp), each as affine_qmm computes it, in one node:
// affine_qmm_many takes (w, scales, biases) triples of one group size and bit width and gives
// one output per triple; affine_swiglu gives silu(x @ gate.T) * (x @ up.T) (silu's kernel).
std::vector<mx::array> affine_qmm_many(const mx::array& x, const std::vector<mx::array>& weights,
                                       int group_size, int bits, mx::StreamOrDevice s = {});
mx::array affine_swiglu(const mx::array& x, const mx::array& gate_w, const mx::array& gate_s,
                        const mx::array& gate_b, const mx::array& up_w, const mx::array& up_s,
                        const mx::array& up_b, int group_size, int bits,
                        mx::StreamOrDevice s = {});

class AffineQmmMany : public mx::Primitive {
 public:
  AffineQmmMany(mx::Stream stream, int group, int bits)
      : mx::Primitive(stream), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MasAffineQmmMany"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_, bits_;
};

class AffineSwiglu : public mx::UnaryPrimitive {
 public:
  AffineSwiglu(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasAffineSwiglu"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {out_shape(inputs[0], inputs[1])};
  }

 private:
  int group_, bits_;
};

class GatedDelta : public mx::Primitive {
 public:
  explicit GatedDelta(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MasGatedDelta"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// The argmax over the vocabulary of x @ w.T, without computing x @ w.T (greedy_head.cpp):
// x [M, K] float32, w [N, K] float32 or bfloat16 (the LM head's weight, exact), wq [N, Kp]
// uint8 (w's rows quantized to int8, + 128, zero past K; Kp a multiple of 64), stats float32
// [3, Np] (Np >= N a multiple of 16): per row of w its scale, ||w[n]||_2 and ||w[n] - scale
// * (wq[n] - 128)||_2 (both rounded up), zero past N -> int32 [M], the lowest index on ties.
// bf16_logits: the argmax of the logits rounded to bfloat16 (a bf16 model's). allowed: uint32
// [M, words >= ceil(N / 32)], bit n % 32 of word n / 32 set where row n may be x[m]'s answer
// (a grammar's mask): the argmax over those only (0 where none is).
mx::array greedy_head(const mx::array& x, const mx::array& w, const mx::array& wq,
                      const mx::array& stats, bool bf16_logits = false,
                      const std::optional<mx::array>& allowed = std::nullopt,
                      mx::StreamOrDevice s = {});

class GreedyHead : public mx::UnaryPrimitive {
 public:
  GreedyHead(mx::Stream stream, bool bf16_logits)
      : mx::UnaryPrimitive(stream), bf16_logits_(bf16_logits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasGreedyHead"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bf16_logits_ == static_cast<const GreedyHead&>(other).bf16_logits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }

 private:
  bool bf16_logits_;
};

// greedy_head for a quantized head (mlx's affine layout, 4 or 8 bits), from its own packed
// words codes [N, K * bits / 32] uint32: table float32 [ceil(N / 16), K / group_size, 2, 16]
// (16 rows' scales of each group, then their biases), stats float32 [3, Np] (unused, ||w[n]||,
// the bound on the float32 rounding of the screening products; greedy_head.py prepares them);
// screen, optionally, the table as float16 for AVX2's screening (stats' bound then covers its
// rounding too).
// K a multiple of 128 (4-bit) or 64 (8-bit) and of group_size (32, 64 or 128).
mx::array greedy_head_quantized(const mx::array& x, const mx::array& codes,
                                const mx::array& table, const mx::array& stats, int group_size,
                                int bits, bool bf16_logits = false,
                                const std::optional<mx::array>& allowed = std::nullopt,
                                const std::optional<mx::array>& screen = std::nullopt,
                                mx::StreamOrDevice s = {});

class GreedyHeadQuantized : public mx::UnaryPrimitive {
 public:
  GreedyHeadQuantized(mx::Stream stream, bool bf16_logits, int group_size, int bits, bool screen)
      : mx::UnaryPrimitive(stream),
        bf16_logits_(bf16_logits),
        group_size_(group_size),
        bits_(bits),
        screen_(screen) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasGreedyHeadQuantized"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GreedyHeadQuantized&>(other);
    return bf16_logits_ == o.bf16_logits_ && group_size_ == o.group_size_ &&
           bits_ == o.bits_ && screen_ == o.screen_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0)}};
  }

 private:
  bool bf16_logits_;
  int group_size_, bits_;
  bool screen_;  // inputs[4] is the float16 screening table
};

// The causal depthwise convolution of the gated-delta layers (gated_delta.cpp), float32:
// x [B, T + K - 1, C] (the K - 1 positions before the chunk, then its T), w [K, C] ->
// [B, T, C], out[b, t, c] = sum_j x[b, t + j, c] w[j, c].
mx::array causal_conv(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

class CausalConv : public mx::UnaryPrimitive {
 public:
  explicit CausalConv(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasCausalConv"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// silu(gate), times x where given (same shape), float32 (activation.cpp): nn.silu and mlx-lm's
// swiglu as one node each.
mx::array silu(const mx::array& gate, const std::optional<mx::array>& x,
               mx::StreamOrDevice s = {});

class Silu : public mx::UnaryPrimitive {
 public:
  explicit Silu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasSilu"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }
};

// Softmax over the last axis of float32 scores [..., rows, width] (activation.cpp).
// causal_length > 0: the rows are queries of a chunk of that many tokens (row r is query
// r % causal_length, at key position width - causal_length + r % causal_length), and keys
// past a query's position get 0: mlx-lm's "causal" mask and the softmax in one pass.
mx::array softmax(const mx::array& scores, int causal_length, mx::StreamOrDevice s = {});

class Softmax : public mx::UnaryPrimitive {
 public:
  Softmax(mx::Stream stream, int length) : mx::UnaryPrimitive(stream), length_(length) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int length_;
};

// The sampling primitives (sampling.cpp): one output per row of their first input, [..., V]
// -> [...]; no parameters of their own, CPU only.
class PerRow : public mx::UnaryPrimitive {
 public:
  explicit PerRow(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {mx::Shape(inputs[0].shape().begin(), inputs[0].shape().end() - 1)};
  }
};

// One token per row drawn from softmax(logits) over the last axis, float32 logits [..., V]
// and one uniform u in [0, 1) per row [...] -> uint32 [...] (sampling.cpp): the first index
// whose running sum of exp(logits - max) over the kept logits passes u times their total.
// Kept: logits >= floor (float32 [...]) where floor is given. -inf logits are never drawn; a
// row that is all -inf gives 0.
mx::array categorical(const mx::array& logits, const mx::array& u,
                      const std::optional<mx::array>& floor, mx::StreamOrDevice s = {});

// mx.argmax(x, axis=-1) for float32 x [..., V] -> uint32 [...] (sampling.cpp): the first NaN
// of a row if it has one, else its first maximum. MLX's CPU argmax is scalar code: 2.2 ms over
// 16 rows of 151,936 logits, this 0.2.
mx::array argmax(const mx::array& x, mx::StreamOrDevice s = {});

class Argmax : public PerRow {
 public:
  using PerRow::PerRow;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasArgmax"; }
};

// Each row's top_k / top_p / min_p threshold, float32 logits [..., V] and per row int32 top_k,
// float32 top_p and log(min_p) [...] -> float32 [...] (sampling.cpp): logits >= it is the set
// that filters.apply_filters keeps (top_p over what top_k keeps, renormalized; ties with the
// threshold kept). top_k <= 0, top_p >= 1, log_min_p = -inf: that filter is off.
mx::array filter_floor(const mx::array& logits, const mx::array& top_k, const mx::array& top_p,
                       const mx::array& log_min_p, mx::StreamOrDevice s = {});

class FilterFloor : public PerRow {
 public:
  using PerRow::PerRow;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasFilterFloor"; }
};

class Categorical : public PerRow {
 public:
  using PerRow::PerRow;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasCategorical"; }
};

// A Qwen3-style dense decode layer (one token per row, float32, affine-quantized projections
// of one group size and bit width) in two nodes around its two pool writes (decode_layer.cpp).
// decode_layer_in: n = rms_norm(x), q/k/v = n @ W.T, q and k each head normed and rotated ->
// (q [rows, heads, 1, dim], k and v [rows, kv_heads, 1, dim]). decode_layer_out: attention of q
// over the pools, h = x + o_proj(a), out = h + down(silu(gate(m)) * up(m)), m = rms_norm(h).
// Each step is the kernel its own node runs, in the same order: the same values bit for bit.
struct LayerIn {
  int heads, kv_heads, rope_dims, group_size, bits;
  bool traditional;
  float eps, q_eps, k_eps, base, scale;
};
std::vector<mx::array> decode_layer_in(const mx::array& x, const mx::array& norm,
                                       const std::vector<mx::array>& qkv, const mx::array& q_norm,
                                       const mx::array& k_norm, const mx::array& offsets,
                                       const LayerIn& p, mx::StreamOrDevice s = {});
mx::array decode_layer_out(const mx::array& x, const mx::array& q, const mx::array& k_pool,
                           const mx::array& v_pool, const mx::array& pages,
                           const mx::array& lengths, float attn_scale,
                           const std::vector<mx::array>& weights, const mx::array& norm,
                           float eps, int group_size, int bits, mx::StreamOrDevice s = {});

class DecodeLayerIn : public mx::Primitive {
 public:
  DecodeLayerIn(mx::Stream stream, const LayerIn& p) : mx::Primitive(stream), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MasDecodeLayerIn"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  LayerIn p_;
};

class DecodeLayerOut : public mx::UnaryPrimitive {
 public:
  DecodeLayerOut(mx::Stream stream, float attn_scale, float eps, int group, int bits)
      : mx::UnaryPrimitive(stream), attn_scale_(attn_scale), eps_(eps), group_(group),
        bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasDecodeLayerOut"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float attn_scale_, eps_;
  int group_, bits_;
};

// The id (Linux gettid) of the thread the CPU stream runs its tasks on, int32 []
// (stream_thread.cpp).
mx::array stream_thread_id(mx::StreamOrDevice s = {});

class StreamThreadId : public mx::UnaryPrimitive {
 public:
  explicit StreamThreadId(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "MasStreamThreadId"; }
  // Never one node for two calls: each asks its own stream, at its own time.
  bool is_equivalent(const mx::Primitive&) const override { return false; }
};

}  // namespace mas

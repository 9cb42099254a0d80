// The MLX operations: lazy graph nodes whose CPU evaluation runs our kernels.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mas {

namespace mx = mlx::core;

// x [..., K] float32 @ dequantize(w, scales, biases).T -> [..., N] float32 (mlx affine mode).
mx::array affine_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits,
                     mx::StreamOrDevice s = {});

// x [..., K] float32 @ w.T with w bfloat16 [N, K] -> [..., N] float32.
mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// x [..., K] float32 @ w.T with w float32 [N, K] -> [..., N] float32 (for few rows of x).
mx::array f32_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// Decode attention over the runner's decode batch: q [rows, heads, 1, dim] float32 (one token
// per row), k and v the batch's page pool [kv_heads, pool pages, page, dim] float32, pages
// [rows, max_pages] int32 (row b's token t is at k[:, pages[b, t / page], t % page]), lengths
// [rows] int32 (row b attends to its tokens 0 .. lengths[b]-1) -> [rows, heads, 1, dim].
mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& pages, const mx::array& lengths, float scale,
                           mx::StreamOrDevice s = {});

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

}  // namespace mas

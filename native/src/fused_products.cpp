// Products that share their input, as one graph node: a layer's q, k and v projections, and an
// MLP's gate and up projections with SwiGLU applied (silu(gate) * up).
//
// Why: on the CPU each graph node costs the thread that queues it and the stream that runs it
// microseconds whatever its size; in a 4-bit decode step at one row a product is a few tens of
// microseconds, so the node's own cost is a good part of it. The values are the separate
// nodes' bit for bit: each product is mas::qmm on its own weights (the same call affine_qmm's
// node makes) and the SwiGLU is mas::silu_values (silu's node).
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "ops.h"

namespace mas {
namespace {

// x and each product's (w, scales, biases), as affine_qmm checks them.
void check_products(const mx::array& x, const std::vector<mx::array>& weights, int group_size,
                    int bits, const std::string& op) {
  if (weights.empty() || weights.size() % 3 != 0) {
    throw std::invalid_argument(op + "weights must be (w, scales, biases) triples");
  }
  for (size_t i = 0; i < weights.size(); i += 3) {
    check_affine_qmm(x, weights[i], weights[i + 1], weights[i + 2], group_size, bits, op);
  }
}


}  // namespace

std::vector<mx::array> affine_qmm_many(const mx::array& x, const std::vector<mx::array>& weights,
                                       int group_size, int bits, mx::StreamOrDevice s) {
  check_products(x, weights, group_size, bits, "affine_qmm_many: ");
  mx::Stream stream = cpu_stream(s, "affine_qmm_many");
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t i = 0; i < weights.size(); i += 3) {
    shapes.push_back(out_shape(x, weights[i]));
    dtypes.push_back(mx::float32);
  }
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<AffineQmmMany>(stream, group_size, bits),
                                inputs);
}

void AffineQmmMany::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, outputs);
  const int64_t K = in[0].shape(-1), M = K ? static_cast<int64_t>(in[0].size()) / K : 0;
  std::vector<QmmArgs> args;
  for (size_t i = 0; i < outputs.size(); ++i) {
    args.push_back(qmm_args(in[0].data<float>(), M, K, in[1 + 3 * i], in[2 + 3 * i],
                           in[3 + 3 * i], group_, bits_, outputs[i].data<float>()));
  }
  if (M == 0) return;
  enc.dispatch([args = std::move(args)]() {
    for (const auto& a : args) qmm(a);
  });
}

void AffineQmmMany::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("mas_kernels.affine_qmm_many has no GPU kernel");
}

bool AffineQmmMany::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AffineQmmMany&>(other);
  return group_ == o.group_ && bits_ == o.bits_;
}

std::vector<mx::Shape> AffineQmmMany::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = 1; i < inputs.size(); i += 3) {
    shapes.push_back(out_shape(inputs[0], inputs[i]));
  }
  return shapes;
}

mx::array affine_swiglu(const mx::array& x, const mx::array& gate_w, const mx::array& gate_s,
                        const mx::array& gate_b, const mx::array& up_w, const mx::array& up_s,
                        const mx::array& up_b, int group_size, int bits, mx::StreamOrDevice s) {
  const std::string op = "affine_swiglu: ";
  check_products(x, {gate_w, gate_s, gate_b, up_w, up_s, up_b}, group_size, bits, op);
  if (gate_w.shape(0) != up_w.shape(0)) {
    throw std::invalid_argument(op + "gate and up must have as many rows, got " +
                                std::to_string(gate_w.shape(0)) + " and " +
                                std::to_string(up_w.shape(0)));
  }
  mx::Stream stream = cpu_stream(s, "affine_swiglu");
  return mx::array(out_shape(x, gate_w), mx::float32,
                   std::make_shared<AffineSwiglu>(stream, group_size, bits),
                   {x, gate_w, gate_s, gate_b, up_w, up_s, up_b});
}

void AffineSwiglu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const int64_t K = in[0].shape(-1), M = K ? static_cast<int64_t>(in[0].size()) / K : 0;
  const int64_t n = static_cast<int64_t>(out.size());
  if (n == 0) return;
  // The two products' buffers, kept alive by the encoder until the task has run.
  mx::array gate(mx::allocator::malloc(out.nbytes()), out.shape(), mx::float32);
  mx::array up(mx::allocator::malloc(out.nbytes()), out.shape(), mx::float32);
  enc.add_temporary(gate);
  enc.add_temporary(up);
  const QmmArgs g = qmm_args(in[0].data<float>(), M, K, in[1], in[2], in[3], group_, bits_,
                            gate.data<float>());
  const QmmArgs u = qmm_args(in[0].data<float>(), M, K, in[4], in[5], in[6], group_, bits_,
                            up.data<float>());
  const ActArgs act{gate.data<void>(), up.data<void>(), out.data<void>(), n, false};
  enc.dispatch([g, u, act]() {
    qmm(g);
    qmm(u);
    silu_values(act);
  });
}

void AffineSwiglu::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.affine_swiglu has no GPU kernel");
}

bool AffineSwiglu::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AffineSwiglu&>(other);
  return group_ == o.group_ && bits_ == o.bits_;
}

}  // namespace mas

// The gated delta rule as one graph node on the CPU: the recurrence of Qwen3.5's linear
// attention layers over a prompt chunk or a decode step (the kernel: gated_delta.inc).
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "mlx/allocator.h"
#include "ops.h"

namespace mas {

std::vector<mx::array> gated_delta(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const mx::array& g, const mx::array& beta,
                                   const mx::array& state, mx::StreamOrDevice s) {
  const std::string op = "gated_delta: ";
  for (const auto* a : {&q, &k, &v, &g, &beta, &state}) {
    if (a->dtype() != mx::float32) throw std::invalid_argument(op + "inputs must be float32");
  }
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4) {
    throw std::invalid_argument(op + "q and k must be one shape [B, T, Hk, Dk] and v [B, T, Hv, "
                                "Dv], got q " + shape_str(q.shape()) + ", k " +
                                shape_str(k.shape()) + ", v " + shape_str(v.shape()));
  }
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);
  if (v.shape(0) != B || v.shape(1) != T || Hk == 0 || Hv % Hk != 0) {
    throw std::invalid_argument(op + "v " + shape_str(v.shape()) + " does not match q " +
                                shape_str(q.shape()) + " (value heads a multiple of key heads)");
  }
  if (Dk % 16 != 0) {
    throw std::invalid_argument(op + "needs Dk a multiple of 16, got " + std::to_string(Dk));
  }
  const mx::Shape gates{B, T, Hv}, states{B, Hv, Dv, Dk};
  if (g.shape() != gates || beta.shape() != gates) {
    throw std::invalid_argument(op + "g and beta must be " + shape_str(gates) + ", got " +
                                shape_str(g.shape()) + " and " + shape_str(beta.shape()));
  }
  if (state.shape() != states) {
    throw std::invalid_argument(op + "state must be " + shape_str(states) + ", got " +
                                shape_str(state.shape()));
  }
  mx::Stream stream = cpu_stream(s, "gated_delta");
  return mx::array::make_arrays({v.shape(), states}, {mx::float32, mx::float32},
                                std::make_shared<GatedDelta>(stream),
                                {q, k, v, g, beta, state});
}

void GatedDelta::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, outputs);
  const mx::array &q = in[0], &v = in[2], &state = in[5];
  DeltaArgs args{q.data<float>(), in[1].data<float>(), v.data<float>(), in[3].data<float>(),
                 in[4].data<float>(), state.data<float>(), outputs[0].data<float>(),
                 outputs[1].data<float>(), q.shape(0), q.shape(1), q.shape(2), v.shape(2),
                 q.shape(3), v.shape(3)};
  if (outputs[0].size() == 0 && outputs[1].size() == 0) return;
  enc.dispatch([args]() { mas::gated_delta(args); });
}

void GatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "mas_kernels.gated_delta has no GPU kernel: use mlx-lm's gated_delta_kernel");
}

std::vector<mx::Shape> GatedDelta::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[2].shape(), inputs[5].shape()};
}

mx::array causal_conv(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  const std::string op = "causal_conv: ";
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument(op + "x and w must be float32");
  }
  if (x.ndim() != 3 || w.ndim() != 2 || w.shape(1) != x.shape(2) || w.shape(0) < 1 ||
      x.shape(1) < w.shape(0) - 1) {
    throw std::invalid_argument(op + "x must be [B, T + K - 1, C] and w [K, C], got x " +
                                shape_str(x.shape()) + " and w " + shape_str(w.shape()));
  }
  mx::Stream stream = cpu_stream(s, "causal_conv");
  const mx::Shape shape{x.shape(0), x.shape(1) - w.shape(0) + 1, x.shape(2)};
  return mx::array(shape, mx::float32, std::make_shared<CausalConv>(stream), {x, w});
}

void CausalConv::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const mx::array &x = in[0], &w = in[1];
  ConvArgs args{x.data<float>(), w.data<float>(), out.data<float>(), out.shape(0),
                out.shape(1), out.shape(2), w.shape(0)};
  if (out.size() == 0) return;
  enc.dispatch([args]() { mas::conv_values(args); });
}

void CausalConv::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.causal_conv has no GPU kernel: use nn.Conv1d");
}

std::vector<mx::Shape> CausalConv::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& x = inputs[0];
  return {{x.shape(0), x.shape(1) - inputs[1].shape(0) + 1, x.shape(2)}};
}

}  // namespace mas

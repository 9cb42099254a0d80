// SiLU (SwiGLU's silu(gate) * x) and the attention softmax as graph nodes on the CPU (the
// kernels: activation.inc). Float32, or bfloat16 with MLX's own bits.
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "mlx/allocator.h"
#include "ops.h"

namespace mas {

mx::array silu(const mx::array& gate, const std::optional<mx::array>& x, mx::StreamOrDevice s) {
  if ((gate.dtype() != mx::float32 && gate.dtype() != mx::bfloat16) ||
      (x && x->dtype() != gate.dtype())) {
    throw std::invalid_argument("silu: gate and x must be both float32 or both bfloat16");
  }
  if (x && x->shape() != gate.shape()) {
    throw std::invalid_argument("silu: x must be gate's shape " + shape_str(gate.shape()) +
                                ", got " + shape_str(x->shape()));
  }
  mx::Stream stream = cpu_stream(s, "silu");
  std::vector<mx::array> inputs{gate};
  if (x) inputs.push_back(*x);
  return mx::array(gate.shape(), gate.dtype(), std::make_shared<Silu>(stream), inputs);
}

void Silu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  ActArgs args{in[0].data<void>(), in.size() > 1 ? in[1].data<void>() : nullptr,
               out.data<void>(), static_cast<int64_t>(out.size()),
               out.dtype() == mx::bfloat16};
  if (args.n == 0) return;
  enc.dispatch([args]() { mas::silu_values(args); });
}

void Silu::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.silu has no GPU kernel: use nn.silu");
}

mx::array softmax(const mx::array& scores, int causal_length, mx::StreamOrDevice s) {
  if (scores.dtype() != mx::float32 && scores.dtype() != mx::bfloat16) {
    throw std::invalid_argument("softmax: scores must be float32 or bfloat16");
  }
  if (scores.ndim() < 2) {
    throw std::invalid_argument("softmax: scores must be [..., rows, width], got " +
                                shape_str(scores.shape()));
  }
  const int rows = scores.shape(-2), width = scores.shape(-1);
  if (causal_length < 0 || causal_length > width ||
      (causal_length > 0 && rows % causal_length != 0)) {
    throw std::invalid_argument("softmax: causal_length must be in [0, width = " +
                                std::to_string(width) + "] and divide the rows (" +
                                std::to_string(rows) + "), got " + std::to_string(causal_length));
  }
  mx::Stream stream = cpu_stream(s, "softmax");
  return mx::array(scores.shape(), scores.dtype(),
                   std::make_shared<Softmax>(stream, causal_length), {scores});
}

void Softmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const mx::array x = cpu_io(enc, inputs, {out})[0];
  const int64_t width = x.shape(-1);
  SoftmaxArgs args{x.data<void>(), out.data<void>(),
                   width ? static_cast<int64_t>(x.size()) / width : 0, width, length_,
                   x.dtype() == mx::bfloat16};
  if (args.rows == 0 || width == 0) return;
  enc.dispatch([args]() { mas::softmax_rows(args); });
}

void Softmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.softmax has no GPU kernel: use mx.softmax");
}

bool Softmax::is_equivalent(const mx::Primitive& other) const {
  return length_ == static_cast<const Softmax&>(other).length_;
}

}  // namespace mas

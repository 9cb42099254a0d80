// The sampled rows' filters and draw as graph nodes on the CPU (the kernels: sampling.inc).
#include <stdexcept>
#include <string>

#include "kernels.h"
#include "ops.h"

namespace mas {
namespace {

// The rows: `name`'s shape without its last axis (each per-row input must have it).
mx::Shape per_row(const char* op, const mx::array& logits, const char* name = "logits") {
  if (logits.dtype() != mx::float32) {
    throw std::invalid_argument(std::string(op) + ": " + name + " must be float32");
  }
  if (logits.ndim() < 1 || logits.shape(-1) == 0) {
    throw std::invalid_argument(std::string(op) + ": " + name + " must be [..., V] with V > 0, "
                                "got " + shape_str(logits.shape()));
  }
  return mx::Shape(logits.shape().begin(), logits.shape().end() - 1);
}

void check_row_input(const char* op, const char* name, const mx::array& a, const mx::Shape& rows,
                     mx::Dtype dtype) {
  if (a.dtype() != dtype) {
    throw std::invalid_argument(std::string(op) + ": " + name + " must be " +
                                (dtype == mx::int32 ? "int32" : "float32"));
  }
  if (a.shape() != rows) {
    throw std::invalid_argument(std::string(op) + ": " + name +
                                " must be logits' shape without its last axis " +
                                shape_str(rows) + ", got " + shape_str(a.shape()));
  }
}

}  // namespace

void PerRow::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // sampling.py takes MLX's own ops off the CPU: mx.argmax, filters.py, the Gumbel-max.
  throw std::runtime_error(std::string("mas_kernels: ") + name() + " has no GPU kernel");
}

mx::array categorical(const mx::array& logits, const mx::array& u,
                      const std::optional<mx::array>& floor, mx::StreamOrDevice s) {
  const mx::Shape rows = per_row("categorical", logits);
  check_row_input("categorical", "u", u, rows, mx::float32);
  std::vector<mx::array> inputs{logits, u};
  if (floor) {
    check_row_input("categorical", "floor", *floor, rows, mx::float32);
    inputs.push_back(*floor);
  }
  mx::Stream stream = cpu_stream(s, "categorical");
  return mx::array(rows, mx::uint32, std::make_shared<Categorical>(stream), inputs);
}

void Categorical::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  CatArgs args{in[0].data<float>(), in[1].data<float>(),
               in.size() > 2 ? in[2].data<float>() : nullptr, out.data<uint32_t>(),
               static_cast<int64_t>(out.size()), in[0].shape(-1)};
  if (args.rows == 0) return;
  enc.dispatch([args]() { mas::categorical_rows(args); });
}

mx::array argmax(const mx::array& x, mx::StreamOrDevice s) {
  const mx::Shape rows = per_row("argmax", x, "x");
  mx::Stream stream = cpu_stream(s, "argmax");
  return mx::array(rows, mx::uint32, std::make_shared<Argmax>(stream), {x});
}

void Argmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  ArgmaxArgs args{in[0].data<float>(), out.data<uint32_t>(), static_cast<int64_t>(out.size()),
                  in[0].shape(-1)};
  if (args.rows == 0) return;
  enc.dispatch([args]() { mas::argmax_rows(args); });
}

mx::array filter_floor(const mx::array& logits, const mx::array& top_k, const mx::array& top_p,
                       const mx::array& log_min_p, mx::StreamOrDevice s) {
  const mx::Shape rows = per_row("filter_floor", logits);
  check_row_input("filter_floor", "top_k", top_k, rows, mx::int32);
  check_row_input("filter_floor", "top_p", top_p, rows, mx::float32);
  check_row_input("filter_floor", "log_min_p", log_min_p, rows, mx::float32);
  mx::Stream stream = cpu_stream(s, "filter_floor");
  return mx::array(rows, mx::float32, std::make_shared<FilterFloor>(stream),
                   {logits, top_k, top_p, log_min_p});
}

void FilterFloor::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  FloorArgs args{in[0].data<float>(), in[1].data<int32_t>(), in[2].data<float>(),
                 in[3].data<float>(), out.data<float>(), static_cast<int64_t>(out.size()),
                 in[0].shape(-1)};
  if (args.rows == 0) return;
  enc.dispatch([args]() { mas::filter_floor_rows(args); });
}

}  // namespace mas

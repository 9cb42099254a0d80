// Which thread runs a CPU stream's tasks, as a graph node.
//
// Why: MLX's CPU stream runs every kernel of a step on one thread, one kernel after another, so
// that thread's time is the step's time. The runner gives it a core of its own and everything
// else the other cores (actors/model_runner/cpu/cores.py); to do that it must know which of its
// threads it is, and MLX does not say. A task queued on the stream can.
#include <sys/syscall.h>
#include <unistd.h>

#include <stdexcept>

#include "mlx/allocator.h"
#include "ops.h"

namespace mas {

mx::array stream_thread_id(mx::StreamOrDevice s) {
  mx::Stream stream = cpu_stream(s, "stream_thread_id");
  return mx::array({}, mx::int32, std::make_shared<StreamThreadId>(stream), {});
}

void StreamThreadId::eval_cpu(const std::vector<mx::array>&, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  cpu_io(enc, {}, {out});
  int32_t* id = out.data<int32_t>();
  enc.dispatch([id]() { *id = static_cast<int32_t>(syscall(SYS_gettid)); });
}

void StreamThreadId::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("stream_thread_id: only a CPU stream runs its tasks on a thread");
}

}  // namespace mas

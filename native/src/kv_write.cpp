// A decode step's new keys and values written into one layer's page pools, as one graph node.
//
// Why: written with MLX's indexing (`flat[index] = new` on each pool seen flat), a layer's
// write is eight nodes (reshapes around two scatters), 64 of a qwen3-small step's ~340. Each
// node costs the CPU stream and the thread that submits it a few microseconds whatever its
// size; here each pool's write is one node. The pool is written in place when MLX's own ops
// could take it over (nothing else holds it); otherwise it is copied first, as MLX's Scatter
// does too. (One node for both pools would not do: each output of a multi-output
// node holds the inputs, so MLX would never let them be donated.)
#include <atomic>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace mas {
namespace {

std::atomic<int64_t> g_copies{0};  // pools copied because they could not be donated

// `out` takes over `pool`'s buffer where MLX would let its own ops donate it (nothing else
// holds it, and it is not a view into a much larger buffer that it would keep alive), or where
// the caller said in_place and it is not such a view; else a copy of it, made on the stream.
void take_or_copy(const mx::array& pool, mx::array& out, mx::cpu::CommandEncoder& enc,
                  bool in_place) {
  if ((in_place || pool.is_donatable()) && pool.flags().row_contiguous &&
      pool.buffer_size() <= pool.nbytes() + (16 << 10)) {
    out.copy_shared_buffer(pool);
    return;
  }
  g_copies.fetch_add(1, std::memory_order_relaxed);
  if (!pool.flags().row_contiguous) {  // row_contiguous makes a fresh copy: take that one
    out.copy_shared_buffer(row_contiguous(pool, enc));
    return;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  enc.set_input_array(pool);
  enc.dispatch([s = pool.data<char>(), d = out.data<char>(), n = out.nbytes()]() {
    std::memcpy(d, s, n);
  });
}

}  // namespace

mx::array kv_write(const mx::array& pool, const mx::array& index, const mx::array& rows,
                   bool in_place, mx::StreamOrDevice s) {
  const std::string op = "kv_write: ";
  if (pool.ndim() != 4) {
    throw std::invalid_argument(op + "pool must be [kv_heads, pages, page, dim], got " +
                                shape_str(pool.shape()));
  }
  const int kv_heads = pool.shape(0), dim = pool.shape(3);
  if (rows.ndim() != 4 || rows.shape(1) != kv_heads || rows.shape(2) != 1 ||
      rows.shape(3) != dim || rows.dtype() != pool.dtype()) {
    throw std::invalid_argument(op + "rows must be [rows, " + std::to_string(kv_heads) +
                                ", 1, " + std::to_string(dim) + "] in the pool's type, got " +
                                shape_str(rows.shape()));
  }
  if (index.dtype() != mx::int32 || index.ndim() != 1 ||
      index.shape(0) != rows.shape(0) * kv_heads) {
    throw std::invalid_argument(op + "index must be int32 [rows x kv_heads] = [" +
                                std::to_string(rows.shape(0) * kv_heads) + "], got " +
                                shape_str(index.shape()));
  }
  mx::Stream stream = cpu_stream(s, "kv_write");
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KvWrite>(stream, in_place),
                   {pool, index, rows});
}

int64_t kv_write_copies() { return g_copies.load(std::memory_order_relaxed); }

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  take_or_copy(inputs[0], out, enc, in_place_);
  const mx::array index = row_contiguous(inputs[1], enc), rows = row_contiguous(inputs[2], enc);
  enc.set_input_array(index);
  enc.set_input_array(rows);
  enc.set_output_array(out);
  const int64_t n = index.size(), slots = out.size() / out.shape(3);
  const size_t row_bytes = static_cast<size_t>(out.shape(3)) * out.itemsize();
  enc.dispatch([idx = index.data<int32_t>(), src = rows.data<char>(), dst = out.data<char>(), n,
                slots, row_bytes]() {
    for (int64_t j = 0; j < n; ++j) {
      // An index past the pool would be a bug of the caller's; it is skipped rather than
      // written over memory that is not the pool's.
      if (idx[j] < 0 || idx[j] >= slots) continue;
      std::memcpy(dst + static_cast<size_t>(idx[j]) * row_bytes, src + j * row_bytes, row_bytes);
    }
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.kv_write has no GPU kernel: use MLX's scatter");
}

}  // namespace mas

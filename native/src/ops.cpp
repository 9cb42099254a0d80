// MLX glue: argument checks, the graph nodes, and their CPU evaluation through the stream's
// command encoder (the work runs in order on MLX's CPU stream thread, never eagerly).
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mas {

mx::Shape out_shape(const mx::array& x, const mx::array& w) {
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return shape;
}

namespace {

// Copy `n` items of `item` bytes laid out by shape/strides (in items) into dst, row-major.
void strided_copy(const char* src, char* dst, const mx::Shape& shape, const mx::Strides& strides,
                  size_t item) {
  const int nd = static_cast<int>(shape.size());
  size_t total = 1;
  for (int d = 0; d < nd; ++d) total *= static_cast<size_t>(shape[d]);
  if (total == 0) return;
  if (nd == 0) {
    std::memcpy(dst, src, item);
    return;
  }
  std::vector<int64_t> idx(nd, 0);
  const int64_t inner = shape[nd - 1], inner_stride = strides[nd - 1];
  for (size_t done = 0; done < total; done += static_cast<size_t>(inner)) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * strides[d];
    const char* s = src + off * static_cast<int64_t>(item);
    if (item == 4) {
      auto* o = reinterpret_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < inner; ++i) std::memcpy(o + i, s + i * inner_stride * 4, 4);
    } else {
      for (int64_t i = 0; i < inner; ++i) {
        std::memcpy(dst + i * item, s + i * inner_stride * static_cast<int64_t>(item), item);
      }
    }
    dst += inner * static_cast<int64_t>(item);
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}


}  // namespace

std::string shape_str(const mx::Shape& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(std::string("mas_kernels.") + op +
                                " runs on the CPU only: pass stream=mx.cpu (or use MLX's own "
                                "kernel on the GPU)");
  }
  return stream;
}

// `a` itself when row-contiguous, else a row-major copy made on the stream (in order, before
// the kernel that reads it) and kept alive by the encoder until that kernel has run.
mx::array row_contiguous(const mx::array& a, mx::cpu::CommandEncoder& enc) {
  if (a.flags().row_contiguous) return a;
  mx::array c(mx::allocator::malloc(a.nbytes()), a.shape(), a.dtype());
  enc.set_input_array(a);
  enc.set_output_array(c);
  enc.dispatch([src = a.data<char>(), dst = c.data<char>(), shape = a.shape(),
                strides = a.strides(), item = a.itemsize()]() {
    strided_copy(src, dst, shape, strides, item);
  });
  enc.add_temporary(c);
  return c;
}

std::vector<mx::array> cpu_io(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& inputs,
                              std::vector<mx::array> outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(row_contiguous(a, enc));
  for (const auto& a : in) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  return in;
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) return ScaleType::f32;
  if (t == mx::float16) return ScaleType::f16;
  return ScaleType::bf16;
}

void check_affine_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                      const mx::array& biases, int group_size, int bits,
                      const std::string& op) {
  if (x.dtype() != mx::float32) {
    throw std::invalid_argument(op + "x must be float32");
  }
  if (x.ndim() < 1) throw std::invalid_argument(op + "x must have at least 1 dimension");
  check_affine_weights(x.shape(-1), w, scales, biases, group_size, bits, op,
                       "x " + shape_str(x.shape()));
}

void check_affine_weights(int64_t K, const mx::array& w, const mx::array& scales,
                          const mx::array& biases, int group_size, int bits,
                          const std::string& op, const std::string& input) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument(op + "bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(op + "group_size must be 32, 64 or 128, got " +
                                std::to_string(group_size));
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    throw std::invalid_argument(op + "w must be a 2-D uint32 array [N, K*bits/32], got " +
                                shape_str(w.shape()));
  }
  const mx::Dtype st = scales.dtype();
  if (st != mx::float32 && st != mx::float16 && st != mx::bfloat16) {
    throw std::invalid_argument(op + "scales must be float32, float16 or bfloat16");
  }
  if (biases.dtype() != st) {
    throw std::invalid_argument(op + "biases must have the dtype of scales");
  }
  if (K == 0) throw std::invalid_argument(op + "K (the last dimension of x) is 0");
  const int64_t N = w.shape(0);
  if (static_cast<int64_t>(w.shape(1)) * 32 / bits != K || K % group_size != 0) {
    throw std::invalid_argument(op + (input.empty() ? "K = " + std::to_string(K) : input) +
                                " does not match w " +
                                shape_str(w.shape()) + " at " + std::to_string(bits) +
                                " bits, group size " + std::to_string(group_size));
  }
  const mx::Shape sshape = {static_cast<int>(N), static_cast<int>(K / group_size)};
  if (scales.shape() != sshape || biases.shape() != sshape) {
    throw std::invalid_argument(op + "scales and biases must be " + shape_str(sshape) +
                                ", got " + shape_str(scales.shape()) + " and " +
                                shape_str(biases.shape()));
  }
}

QmmArgs qmm_args(const float* x, int64_t M, int64_t K, const mx::array& w, const mx::array& scales,
                 const mx::array& biases, int group_size, int bits, float* out) {
  QmmArgs a;
  a.x = x;
  a.w = w.data<uint32_t>();
  a.scales = scales.data<void>();
  a.biases = biases.data<void>();
  a.st = scale_type(scales.dtype());
  a.out = out;
  a.M = M;
  a.N = w.shape(0);
  a.K = K;
  a.group_size = group_size;
  a.bits = bits;
  return a;
}

mx::array affine_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, int group_size, int bits, mx::StreamOrDevice s) {
  check_affine_qmm(x, w, scales, biases, group_size, bits, "affine_qmm: ");
  mx::Stream stream = cpu_stream(s, "affine_qmm");
  return mx::array(out_shape(x, w), mx::float32,
                   std::make_shared<AffineQmm>(stream, group_size, bits),
                   {x, w, scales, biases});
}

void AffineQmm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  mx::array x = row_contiguous(inputs[0], enc);
  mx::array w = row_contiguous(inputs[1], enc);
  mx::array sc = row_contiguous(inputs[2], enc);
  mx::array bi = row_contiguous(inputs[3], enc);
  for (const auto& a : {x, w, sc, bi}) enc.set_input_array(a);
  enc.set_output_array(out);
  const int64_t K = x.shape(-1);
  const QmmArgs args = qmm_args(x.data<float>(), static_cast<int64_t>(x.size()) / K, K, w, sc,
                                bi, group_size_, bits_, out.data<float>());
  enc.dispatch([args]() { qmm(args); });
}

void AffineQmm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "mas_kernels.affine_qmm has no GPU kernel: use mx.quantized_matmul on the GPU");
}

bool AffineQmm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AffineQmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> AffineQmm::output_shapes(const std::vector<mx::array>& inputs) {
  return {out_shape(inputs[0], inputs[1])};
}

namespace {

mx::array dense_matmul(const mx::array& x, const mx::array& w, mx::Dtype wtype, const char* op,
                       mx::StreamOrDevice s) {
  const std::string name(op);
  if (x.dtype() != mx::float32) throw std::invalid_argument(name + ": x must be float32");
  if (w.dtype() != wtype || w.ndim() != 2) {
    throw std::invalid_argument(name + ": w must be a 2-D " +
                                (wtype == mx::float32 ? "float32" : "bfloat16") +
                                " array [N, K]");
  }
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument(name + ": x " + shape_str(x.shape()) + " does not match w " +
                                shape_str(w.shape()));
  }
  mx::Stream stream = cpu_stream(s, op);
  return mx::array(out_shape(x, w), mx::float32, std::make_shared<DenseMatmul>(stream), {x, w});
}

}  // namespace

mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  return dense_matmul(x, w, mx::bfloat16, "bf16_matmul", s);
}

mx::array f32_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  return dense_matmul(x, w, mx::float32, "f32_matmul", s);
}

void DenseMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  mx::array x = row_contiguous(inputs[0], enc);
  mx::array w = row_contiguous(inputs[1], enc);
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_output_array(out);
  const int64_t K = x.shape(-1);
  if (K == 0) {  // empty sum
    enc.dispatch([o = out.data<float>(), n = out.size()]() {
      std::memset(o, 0, n * sizeof(float));
    });
    return;
  }
  const int64_t M = static_cast<int64_t>(x.size()) / K, N = w.shape(0);
  if (w.dtype() == mx::float32) {
    F32Args args{x.data<float>(), w.data<float>(), out.data<float>(), M, N, K};
    enc.dispatch([args]() { f32mm(args); });
  } else {
    Bf16Args args{x.data<float>(), w.data<uint16_t>(), out.data<float>(), M, N, K};
    enc.dispatch([args]() { bf16mm(args); });
  }
}

void DenseMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "mas_kernels' dense matmuls have no GPU kernel: use x @ w.T on the GPU");
}

std::vector<mx::Shape> DenseMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {out_shape(inputs[0], inputs[1])};
}

void check_decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                            const mx::array& pages, const mx::array& lengths,
                            const std::string& op) {
  if ((q.dtype() != mx::float32 && q.dtype() != mx::bfloat16) || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype()) {
    throw std::invalid_argument(op + "q, k and v must be all float32 or all bfloat16");
  }
  if (q.ndim() != 4 || q.shape(2) != 1) {
    throw std::invalid_argument(op + "q must be [rows, heads, 1, dim], got " +
                                shape_str(q.shape()));
  }
  if (k.ndim() != 4 || k.shape() != v.shape()) {
    throw std::invalid_argument(op + "k and v must be one shape [kv_heads, pages, page, dim], "
                                "got " + shape_str(k.shape()) + " and " + shape_str(v.shape()));
  }
  const int rows = q.shape(0), heads = q.shape(1), dim = q.shape(3), kv_heads = k.shape(0);
  if (k.shape(3) != dim || kv_heads == 0 || heads % kv_heads != 0) {
    throw std::invalid_argument(op + "q " + shape_str(q.shape()) + " does not match k " +
                                shape_str(k.shape()));
  }
  if (dim % 16 != 0 || heads / kv_heads > 64) {
    throw std::invalid_argument(op + "needs dim a multiple of 16 and at most 64 query heads per "
                                "KV head, got dim " + std::to_string(dim) + ", " +
                                std::to_string(heads / std::max(kv_heads, 1)) + " per KV head");
  }
  if (pages.dtype() != mx::int32 || pages.ndim() != 2 || pages.shape(0) != rows) {
    throw std::invalid_argument(op + "pages must be int32 [rows, max_pages] with rows = " +
                                std::to_string(rows) + ", got " + shape_str(pages.shape()));
  }
  if (lengths.dtype() != mx::int32 || lengths.shape() != mx::Shape{rows}) {
    throw std::invalid_argument(op + "lengths must be int32 [rows] = [" + std::to_string(rows) +
                                "], got " + shape_str(lengths.shape()));
  }
}

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const mx::array& pages, const mx::array& lengths, float scale,
                           mx::StreamOrDevice s) {
  check_decode_attention(q, k, v, pages, lengths, "decode_attention: ");
  mx::Stream stream = cpu_stream(s, "decode_attention");
  return mx::array(q.shape(), q.dtype(), std::make_shared<DecodeAttention>(stream, scale),
                   {q, k, v, pages, lengths});
}

AttnArgs attn_args(const mx::array& q, const mx::array& k, const mx::array& v,
                   const mx::array& pages, const mx::array& lengths, void* out, float scale) {
  return AttnArgs{q.data<void>(), k.data<void>(), v.data<void>(), pages.data<int32_t>(),
                  lengths.data<int32_t>(), out, q.shape(0), q.shape(1), k.shape(0), k.shape(2),
                  pages.shape(1), k.shape(1), q.shape(3), scale, q.dtype() == mx::bfloat16};
}

void check_attention_reads(const AttnArgs& args, const char* op) {
  // A length past the row's pages, or a page id past the pool, would read past the buffers.
  for (int64_t b = 0; b < args.rows; ++b) {
    const int64_t length = args.lengths[b];
    if (length > args.max_pages * args.page) {
      throw std::out_of_range(std::string(op) + "a row's length is past its pages");
    }
    for (int64_t p = 0; p * args.page < length; ++p) {
      const int32_t id = args.pages[b * args.max_pages + p];
      if (id < 0 || id >= args.pool_pages) {
        throw std::out_of_range(std::string(op) + "a page id is outside the K/V pool");
      }
    }
  }
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  mx::array q = row_contiguous(inputs[0], enc);
  mx::array k = row_contiguous(inputs[1], enc);
  mx::array v = row_contiguous(inputs[2], enc);
  mx::array pages = row_contiguous(inputs[3], enc);
  mx::array lengths = row_contiguous(inputs[4], enc);
  for (const auto& a : {q, k, v, pages, lengths}) enc.set_input_array(a);
  enc.set_output_array(out);
  const AttnArgs args = attn_args(q, k, v, pages, lengths, out.data<void>(), scale_);
  enc.dispatch([args]() {
    check_attention_reads(args, "decode_attention: ");
    mas::attention(args);
  });
}

void DecodeAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "mas_kernels.decode_attention has no GPU kernel: use mx.fast.scaled_dot_product_attention");
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  return scale_ == static_cast<const DecodeAttention&>(other).scale_;
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mas

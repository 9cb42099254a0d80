// A Qwen3-style dense decode layer with affine-quantized projections, as two graph nodes
// around its two pool writes, where it was twelve.
//
// Why: on the CPU each graph node costs the thread that queues it and the stream that runs it
// microseconds whatever its size. In qwen3-small-4bit's decode step at one row, 96 extra
// trivial nodes cost 0.3-0.8 ms a step (a 4-bit step is ~5 ms): the layers' nodes (norms,
// products, norm+RoPE, attention, adds) were most of the step's 134. Each node here runs the
// kernels the separate nodes run, on the same inputs, in the same order, so the values are
// theirs bit for bit. The pool writes stay nodes of their own (kv_write.cpp): an output of a
// multi-output node holds the node's inputs, so a pool written by one could never be donated.
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "ops.h"

namespace mas {
namespace {

// A float32 scratch buffer of `n` values, kept alive by the encoder until the task has run.
float* scratch(mx::cpu::CommandEncoder& enc, int64_t n) {
  mx::array a(mx::allocator::malloc(static_cast<size_t>(n) * sizeof(float)),
              {static_cast<int>(n)}, mx::float32);
  enc.add_temporary(a);
  return a.data<float>();
}

// x [rows, 1, hidden] float32, as both nodes take it; returns rows.
int check_hidden(const mx::array& x, const mx::array& norm, const std::string& op) {
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(1) != 1) {
    throw std::invalid_argument(op + "x must be float32 [rows, 1, hidden], got " +
                                shape_str(x.shape()));
  }
  check_norm(x, norm, x.shape(2), op);
  return x.shape(0);
}

void add_rows(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

std::vector<mx::array> decode_layer_in(const mx::array& x, const mx::array& norm,
                                       const std::vector<mx::array>& qkv, const mx::array& q_norm,
                                       const mx::array& k_norm, const mx::array& offsets,
                                       const LayerIn& p, mx::StreamOrDevice s) {
  const std::string op = "decode_layer_in: ";
  const int rows = check_hidden(x, norm, op);
  if (qkv.size() != 9) {
    throw std::invalid_argument(op + "qkv must be the (w, scales, biases) of q, k and v");
  }
  for (int i = 0; i < 9; i += 3) {
    check_affine_weights(x.shape(2), qkv[i], qkv[i + 1], qkv[i + 2], p.group_size, p.bits, op);
  }
  if (p.heads <= 0 || p.kv_heads <= 0 || qkv[0].shape(0) % p.heads != 0) {
    throw std::invalid_argument(op + "q's " + std::to_string(qkv[0].shape(0)) +
                                " outputs are not " + std::to_string(p.heads) + " heads");
  }
  const int dim = qkv[0].shape(0) / p.heads;
  if (qkv[3].shape(0) != p.kv_heads * dim || qkv[6].shape(0) != p.kv_heads * dim) {
    throw std::invalid_argument(op + "k and v must have " + std::to_string(p.kv_heads) +
                                " heads of " + std::to_string(dim) + ", got " +
                                shape_str(qkv[3].shape()) + " and " + shape_str(qkv[6].shape()));
  }
  for (const mx::array* w : {&q_norm, &k_norm}) {
    if (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != dim) {
      throw std::invalid_argument(op + "q_norm and k_norm must be float32 [" +
                                  std::to_string(dim) + "], got " + shape_str(w->shape()));
    }
  }
  check_rope(p.rope_dims, dim, offsets, rows, op, "rows");
  std::vector<mx::array> inputs{x, norm};
  inputs.insert(inputs.end(), qkv.begin(), qkv.end());
  inputs.insert(inputs.end(), {q_norm, k_norm, offsets});
  return mx::array::make_arrays(
      {{rows, p.heads, 1, dim}, {rows, p.kv_heads, 1, dim}, {rows, p.kv_heads, 1, dim}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecodeLayerIn>(cpu_stream(s, "decode_layer_in"), p), inputs);
}

void DecodeLayerIn::eval_cpu(const std::vector<mx::array>& inputs,
                             std::vector<mx::array>& outputs) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, outputs);
  const int64_t rows = in[0].shape(0), hidden = in[0].shape(2), dim = outputs[0].shape(3);
  if (rows == 0) return;
  float* normed = scratch(enc, rows * hidden);
  std::vector<QmmArgs> products;
  for (int i = 0; i < 3; ++i) {
    products.push_back(qmm_args(normed, rows, hidden, in[2 + 3 * i], in[3 + 3 * i],
                                in[4 + 3 * i], p_.group_size, p_.bits,
                                outputs[i].data<float>()));
  }
  const int32_t* off = in[13].data<int32_t>();
  const int64_t per_row = in[13].shape(0) == 1 ? 0 : 1;
  enc.dispatch([x = in[0].data<float>(), w = in[1].data<float>(), qw = in[11].data<float>(),
                kw = in[12].data<float>(), normed, products, off, per_row, rows, hidden, dim,
                p = p_]() {
    rms_rows_f32(x, w, normed, rows, hidden, p.eps);
    for (const auto& a : products) qmm(a);
    // norm_rope's two passes, on each product's own buffer ([rows, heads x dim] is
    // [rows, heads, 1, dim] in memory).
    const std::pair<float*, int64_t> heads[2] = {{products[0].out, p.heads},
                                                 {products[1].out, p.kv_heads}};
    const float* weights[2] = {qw, kw};
    const float eps[2] = {p.q_eps, p.k_eps};
    for (int i = 0; i < 2; ++i) {
      rms_rows_f32(heads[i].first, weights[i], heads[i].first, rows * heads[i].second, dim,
                   eps[i]);
      rope_rows_f32(heads[i].first, off, heads[i].first, rows, heads[i].second, dim, per_row,
                    p.rope_dims, p.traditional, p.base, p.scale);
    }
  });
}

void DecodeLayerIn::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("mas_kernels.decode_layer_in has no GPU kernel");
}

bool DecodeLayerIn::is_equivalent(const mx::Primitive& other) const {
  const LayerIn& o = static_cast<const DecodeLayerIn&>(other).p_;
  return p_.heads == o.heads && p_.kv_heads == o.kv_heads && p_.rope_dims == o.rope_dims &&
         p_.group_size == o.group_size && p_.bits == o.bits && p_.traditional == o.traditional &&
         p_.eps == o.eps && p_.q_eps == o.q_eps && p_.k_eps == o.k_eps && p_.base == o.base &&
         p_.scale == o.scale;
}

mx::array decode_layer_out(const mx::array& x, const mx::array& q, const mx::array& k_pool,
                           const mx::array& v_pool, const mx::array& pages,
                           const mx::array& lengths, float attn_scale,
                           const std::vector<mx::array>& weights, const mx::array& norm,
                           float eps, int group_size, int bits, mx::StreamOrDevice s) {
  const std::string op = "decode_layer_out: ";
  const int rows = check_hidden(x, norm, op);
  if (q.dtype() != mx::float32 || q.ndim() != 4 || q.shape(0) != rows) {
    throw std::invalid_argument(op + "q must be float32 [rows, heads, 1, dim] with x's " +
                                std::to_string(rows) + " rows, got " + shape_str(q.shape()));
  }
  check_decode_attention(q, k_pool, v_pool, pages, lengths, op);
  if (weights.size() != 12) {
    throw std::invalid_argument(
        op + "weights must be the (w, scales, biases) of o_proj, gate, up and down");
  }
  const int hidden = x.shape(2);
  const std::string names[4] = {"o_proj", "gate", "up", "down"};
  const int64_t ins[4] = {static_cast<int64_t>(q.shape(1)) * q.shape(3), hidden, hidden,
                          weights[3].shape(0)};
  for (int i = 0; i < 4; ++i) {
    check_affine_weights(ins[i], weights[3 * i], weights[3 * i + 1], weights[3 * i + 2],
                         group_size, bits, op + names[i] + ": ");
  }
  if (weights[0].shape(0) != hidden || weights[9].shape(0) != hidden ||
      weights[6].shape(0) != weights[3].shape(0)) {
    throw std::invalid_argument(op + "o_proj and down must give " + std::to_string(hidden) +
                                " values and up as many as gate, got " +
                                shape_str(weights[0].shape()) + ", " +
                                shape_str(weights[9].shape()) + ", " +
                                shape_str(weights[3].shape()) + ", " +
                                shape_str(weights[6].shape()));
  }
  std::vector<mx::array> inputs{x, q, k_pool, v_pool, pages, lengths, norm};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<DecodeLayerOut>(cpu_stream(s, "decode_layer_out"), attn_scale, eps,
                                       group_size, bits),
      inputs);
}

void DecodeLayerOut::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto in = cpu_io(enc, inputs, {out});
  const int64_t rows = in[0].shape(0), hidden = in[0].shape(2);
  if (rows == 0) return;
  const mx::array &q = in[1], &wo = in[7], &wg = in[10];
  const int64_t width = static_cast<int64_t>(q.shape(1)) * q.shape(3), inner = wg.shape(0);
  float* attended = scratch(enc, rows * width);
  float* projected = scratch(enc, rows * hidden);  // o_proj's output, then down's
  float* h = scratch(enc, rows * hidden);
  float* normed = scratch(enc, rows * hidden);
  float* gate = scratch(enc, rows * inner);
  float* up = scratch(enc, rows * inner);
  const AttnArgs attn = attn_args(q, in[2], in[3], in[4], in[5], attended, attn_scale_);
  const QmmArgs o = qmm_args(attended, rows, width, wo, in[8], in[9], group_, bits_, projected);
  const QmmArgs g = qmm_args(normed, rows, hidden, wg, in[11], in[12], group_, bits_, gate);
  const QmmArgs u = qmm_args(normed, rows, hidden, in[13], in[14], in[15], group_, bits_, up);
  const QmmArgs d = qmm_args(gate, rows, inner, in[16], in[17], in[18], group_, bits_,
                             projected);
  const ActArgs act{gate, up, gate, rows * inner, false};
  enc.dispatch([x = in[0].data<float>(), w = in[6].data<float>(), res = out.data<float>(), attn,
                o, g, u, d, act, h, normed, projected, n = rows * hidden, rows, hidden,
                eps = eps_]() {
    check_attention_reads(attn, "decode_layer_out: ");
    attention(attn);
    qmm(o);
    add_rows(x, projected, h, n);
    rms_rows_f32(h, w, normed, rows, hidden, eps);
    qmm(g);
    qmm(u);
    silu_values(act);
    qmm(d);
    add_rows(h, projected, res, n);
  });
}

void DecodeLayerOut::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mas_kernels.decode_layer_out has no GPU kernel");
}

bool DecodeLayerOut::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecodeLayerOut&>(other);
  return attn_scale_ == o.attn_scale_ && eps_ == o.eps_ && group_ == o.group_ &&
         bits_ == o.bits_;
}

}  // namespace mas

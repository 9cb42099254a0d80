// Python module mas_kernels._ext (nanobind, in MLX's domain so mx.array converts both ways).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "kernels.h"
#include "mlx/compile.h"
#include "ops.h"

namespace mx = mlx::core;

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() =
      "Quantized (affine), bfloat16 and float32 matmul kernels, decode attention, RMS norm, "
      "RoPE, the gated delta rule with its convolution, SiLU and softmax for MLX on the CPU";
  m.attr("mlx_version") = MAS_MLX_VERSION;

  m.def("affine_qmm", &mas::affine_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a = 64, "bits"_a = 4, nb::kw_only(), "stream"_a = nb::none(),
        "x [..., K] float32 @ dequantize(w, scales, biases).T -> [..., N] float32.\n\n"
        "Same result as mx.quantized_matmul(x, w, scales, biases, transpose=True, "
        "group_size=group_size, bits=bits) for mlx's affine layout; scales and biases may be "
        "float32, float16 or bfloat16.");
  m.def(
      "affine_qmm_many",
      [](const mx::array& x, const std::vector<mx::array>& weights, int group_size, int bits,
         mx::StreamOrDevice s) {
        auto out = mas::affine_qmm_many(x, weights, group_size, bits, s);
        nb::list got;
        for (auto& a : out) got.append(a);
        return nb::tuple(got);
      },
      "x"_a, "weights"_a, "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
      "Products of one x by several weights as one graph node: weights is a flat list of "
      "(w, scales, biases) triples of one group size and bit width; -> one output per triple, "
      "each affine_qmm(x, w, scales, biases) bit for bit.");
  m.def("affine_swiglu", &mas::affine_swiglu, "x"_a, "gate_w"_a, "gate_scales"_a,
        "gate_biases"_a, "up_w"_a, "up_scales"_a, "up_biases"_a, "group_size"_a, "bits"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "silu(x @ gate.T) * (x @ up.T) for affine-quantized gate and up weights as one graph "
        "node: silu(affine_qmm(x, gate...), affine_qmm(x, up...)) bit for bit.");
  m.def(
      "decode_layer_in",
      [](const mx::array& x, const mx::array& norm, const std::vector<mx::array>& qkv,
         const mx::array& q_norm, const mx::array& k_norm, const mx::array& offsets, int heads,
         int kv_heads, float eps, float q_eps, float k_eps, int rope_dims, bool traditional,
         float base, float scale, int group_size, int bits, mx::StreamOrDevice s) {
        const mas::LayerIn p{heads, kv_heads, rope_dims, group_size, bits, traditional,
                             eps, q_eps, k_eps, base, scale};
        auto out = mas::decode_layer_in(x, norm, qkv, q_norm, k_norm, offsets, p, s);
        return nb::make_tuple(out[0], out[1], out[2]);
      },
      "x"_a, "norm"_a, "qkv"_a, "q_norm"_a, "k_norm"_a, "offsets"_a, "heads"_a, "kv_heads"_a,
      "eps"_a, "q_eps"_a, "k_eps"_a, "rope_dims"_a, "traditional"_a, "base"_a, "scale"_a,
      "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
      "A decode layer's attention input as one graph node: x [rows, 1, hidden] float32, "
      "n = rms_norm(x, norm, eps), qkv the (w, scales, biases) of q, k and v (affine, one group "
      "size and bit width); q and k as norm_rope(n @ W.T, q_norm / k_norm, ...) at offsets. -> "
      "(q [rows, heads, 1, dim], k and v [rows, kv_heads, 1, dim]), those nodes' values bit for "
      "bit.");
  m.def("decode_layer_out", &mas::decode_layer_out, "x"_a, "q"_a, "k_pool"_a, "v_pool"_a,
        "pages"_a, "lengths"_a, "attn_scale"_a, "weights"_a, "norm"_a, "eps"_a, "group_size"_a,
        "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "The rest of a decode layer as one graph node: a = decode_attention(q, k_pool, v_pool, "
        "pages, lengths, attn_scale), h = x + o_proj(a), m = rms_norm(h, norm, eps), -> h + "
        "down(silu(gate(m)) * up(m)); weights the (w, scales, biases) of o_proj, gate, up and "
        "down. Those nodes' values bit for bit.");
  m.def("bf16_matmul", &mas::bf16_matmul, "x"_a, "w"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x [..., K] float32 @ w.T with w bfloat16 [N, K] -> [..., N] float32.");
  m.def("f32_matmul", &mas::f32_matmul, "x"_a, "w"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x [..., K] float32 @ w.T with w float32 [N, K] -> [..., N] float32: one pass over w, "
        "for few rows of x.");

  m.def("decode_attention", &mas::decode_attention, "q"_a, "k"_a, "v"_a, "pages"_a,
        "lengths"_a, "scale"_a, nb::kw_only(), "stream"_a = nb::none(),
        "One query token per row against the decode batch's page pool: q [rows, heads, 1, "
        "dim], k and v [kv_heads, pool pages, page, dim] (all float32, or all bfloat16, rounded "
        "where MLX's bf16 attention rounds), pages int32 [rows, max_pages], lengths int32 [rows]: row b attends to its tokens 0 .. lengths[b]-1, token "
        "t at k[:, pages[b, t // page], t % page]. -> [rows, heads, 1, dim].");
  m.def("rms_norm", &mas::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "weight * x / sqrt(mean(x^2) + eps) over the last axis, float32: mx.fast.rms_norm as "
        "one graph node on the CPU.");
  m.def("rope", &mas::rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offsets"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "Rotary position embedding of x [batch, heads, tokens, dim] float32, token t of row b "
        "at position offsets[b] + t (offsets int32 [1] or [batch]): mx.fast.rope as one graph "
        "node on the CPU.");
  m.def("norm_rope", &mas::norm_rope, "x"_a, "weight"_a, "eps"_a, "heads"_a, "dims"_a,
        "traditional"_a, "base"_a, "scale"_a, "offsets"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "One token per row: rope(rms_norm(x.reshape(rows, heads, 1, dim), weight, eps), ...) "
        "for x [rows, 1, heads x dim] (float32 or bfloat16), as one graph node, bit for bit "
        "the two nodes' values. -> [rows, heads, 1, dim].");
  m.def("greedy_head", &mas::greedy_head, "x"_a, "w"_a, "wq"_a, "stats"_a,
        "bf16_logits"_a = false, "allowed"_a = nb::none(), nb::kw_only(),
        "stream"_a = nb::none(),
        "argmax(x @ w.T, axis=-1) for x [M, K] float32 and the LM head w [N, K] (float32 or "
        "bfloat16), from wq and stats (cpu/greedy_head.py prepares them): int8 products with "
        "error bounds pick the rows that can still win, their exact products decide. -> int32 "
        "[M], the lowest index on ties. bf16_logits: of the logits rounded to bfloat16. allowed: "
        "uint32 [M, words >= ceil(N / 32)] bit masks (bit t % 32 of word t // 32: token t may "
        "win), a grammar's: the argmax over the allowed tokens (0 where none is).");
  m.def("greedy_head_quantized", &mas::greedy_head_quantized, "x"_a, "codes"_a, "table"_a,
        "stats"_a, "group_size"_a, "bits"_a, "bf16_logits"_a = false, "allowed"_a = nb::none(),
        "screen"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "greedy_head for a quantized LM head (mlx's affine layout, 4 or 8 bits) from its own "
        "packed words codes [N, K * bits / 32] uint32, with table and stats "
        "(cpu/greedy_head.py prepares them): integer products over the codes, scaled per group, "
        "with a bound on x's quantization pick the rows that can still win; their exact products "
        "decide. screen: the table as float16, which AVX2 screens with (stats' bound covering its "
        "rounding). -> int32 [M].");
  m.def("qhead_fast", &mas::qhead_fast,
        "Whether greedy_head_quantized has a vectorized path on this CPU (AVX-512 VNNI).");
  m.def(
      "gated_delta",
      [](const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
         const mx::array& beta, const mx::array& state, mx::StreamOrDevice s) {
        auto out = mas::gated_delta(q, k, v, g, beta, state, s);
        return nb::make_tuple(out[0], out[1]);
      },
      "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a, "state"_a, nb::kw_only(), "stream"_a = nb::none(),
      "The gated delta rule token by token, float32: q, k [B, T, Hk, Dk] (Dk a multiple of 16), "
      "v [B, T, Hv, Dv], g and beta [B, T, Hv], state [B, Hv, Dv, Dk] -> (y [B, T, Hv, Dv], "
      "the final state): mlx-lm's gated_delta_ops (scalar gates, no mask) as one graph node.");
  m.def("kv_write", &mas::kv_write, "pool"_a, "index"_a, "rows"_a, nb::kw_only(),
        "in_place"_a = false, "stream"_a = nb::none(),
        "A decode step's writes into one page pool as one graph node: pool [kv_heads, pages, "
        "page, dim] with row j of rows [n, kv_heads, 1, dim] (seen as [n x kv_heads, dim], the "
        "pool's type) at slot index[j] (int32 [n x kv_heads]) of the pool seen flat as "
        "[kv_heads x pages x page, dim]. -> the pool, written in place where it can be donated; "
        "in_place: wherever it is row-contiguous, even where something else holds it (its "
        "owner queues every read of the old contents before the write, on the same stream).");
  m.def("quantized_rows", &mas::quantized_rows, "w"_a, "scales"_a, "biases"_a, "ids"_a,
        "group_size"_a, "bits"_a, "float32"_a = false, nb::kw_only(), "stream"_a = nb::none(),
        "Rows ids (int32 [n]) of a quantized table (w uint32 [vocab, K * bits / 32], mlx's "
        "affine layout, bits 4 or 8; scales and biases [vocab, K / group_size], float32 or "
        "bfloat16) dequantized as one graph node: mx.dequantize(w[ids], scales[ids], "
        "biases[ids]) bit for bit, -> [n, K] in the scales' type, or float32 with float32.");
  m.def("_kv_write_copies", &mas::kv_write_copies,
        "How many pools kv_write had to copy (not donated) since the module loaded.");
  m.def("causal_conv", &mas::causal_conv, "x"_a, "w"_a, nb::kw_only(), "stream"_a = nb::none(),
        "The gated-delta layers' causal depthwise convolution, float32: x [B, T + K - 1, C] "
        "(the K - 1 positions before the chunk, then its T), w [K, C] -> [B, T, C], out[b, t, "
        "c] = sum_j x[b, t + j, c] w[j, c].");
  m.def("silu", &mas::silu, "gate"_a, "x"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) = gate * sigmoid(gate), times x where given (gate's shape), float32: nn.silu "
        "and mlx-lm's swiglu as one graph node, exp vectorized.");
  m.def("softmax", &mas::softmax, "scores"_a, "causal_length"_a = 0, nb::kw_only(),
        "stream"_a = nb::none(),
        "Softmax over the last axis of scores [..., rows, width], float32, or bfloat16 with "
        "the bits of mx.softmax(scores, precise=True). causal_length > 0: "
        "rows are queries of a chunk of that many tokens (row r is query r % causal_length, at "
        "key position width - causal_length + r % causal_length); later keys get 0.");
  m.def("categorical", &mas::categorical, "logits"_a, "u"_a, "floor"_a = nb::none(),
        nb::kw_only(), "stream"_a = nb::none(),
        "One token per row drawn from softmax(logits) over the last axis: float32 logits [..., "
        "V], one uniform u in [0, 1) per row [...] -> uint32 [...], the first index whose "
        "running sum of exp(logits - max) over the kept logits passes u times their total. "
        "Kept: logits >= floor (float32 [...]) where given; -inf is never drawn.");
  m.def("argmax", &mas::argmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.argmax(x, axis=-1) for float32 x [..., V] -> uint32 [...]: the first NaN of a row "
        "if it has one, else its first maximum; vectorized.");
  m.def("filter_floor", &mas::filter_floor, "logits"_a, "top_k"_a, "top_p"_a, "log_min_p"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "Each row's top_k / top_p / min_p threshold: float32 logits [..., V], per row int32 "
        "top_k, float32 top_p and log(min_p) [...] -> float32 [...]; logits >= it is what "
        "filters.apply_filters keeps. top_k <= 0, top_p >= 1, log_min_p = -inf: off.");
  m.def("qhead_half_table", &mas::qhead_half_table,
        "Whether greedy_head_quantized screens with its float16 table (screen) on the path in "
        "use: AVX2's, also on AVX-512 CPUs without VNNI; the others read the float32 table.");
  m.def("head_x_levels", &mas::head_x_levels,
        "The levels x is quantized to by greedy_head on the path in use (127, or 63 on AVX2).");
  m.def("isa", [] { return std::string(mas::isa_name(mas::current_isa())); },
        "The kernel path in use: 'avx512', 'avx2' or 'scalar'.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        for (auto isa : {mas::Isa::avx512, mas::Isa::avx2, mas::Isa::scalar}) {
          if (name != mas::isa_name(isa)) continue;
          if (!mas::cpu_has(isa)) {
            throw nb::value_error(("this CPU (or build) has no " + name + " path").c_str());
          }
          mas::select_isa(isa);
          return;
        }
        throw nb::value_error(
            ("unknown path " + name + ": one of 'avx512', 'avx2', 'scalar'").c_str());
      },
      "name"_a, "Force a kernel path (for tests and benchmarks); ValueError if the CPU lacks it.");
  m.def(
      "has_isa",
      [](const std::string& name) {
        for (auto isa : {mas::Isa::avx512, mas::Isa::avx2, mas::Isa::scalar}) {
          if (name == mas::isa_name(isa)) return mas::cpu_has(isa);
        }
        return false;
      },
      "name"_a, "Whether this CPU and build can run the named path.");
  m.def("threads", &mas::num_threads, "Threads a product is split across.");
  m.def(
      "set_threads",
      [](int n) {
        if (n < 1) throw nb::value_error("set_threads: n must be >= 1");
        mas::set_num_threads(n);
      },
      "n"_a, "Split products across n threads (the calling thread included).");
  m.def("set_worker_cpus", &mas::set_worker_cpus, "cpus"_a,
        "The CPUs the pool's worker threads run on, those made now and later (empty: wherever "
        "the thread that makes them may). ValueError for a CPU number out of range.");
  m.def("stream_thread_id", &mas::stream_thread_id, nb::kw_only(), "stream"_a = nb::none(),
        "int32 []: the id (Linux gettid) of the thread the CPU stream runs its tasks on, once "
        "evaluated.");
  m.def("_set_spin", &mas::set_spin_loops, "loops"_a,
        "Benchmark knob: pause loops (~35 ns each) an idle worker polls before sleeping.");
  // MLX's Python API can only turn compile on or off; the runner's compiled decode traces
  // with fusion off (mode no_fuse): the replayed graph is the eager one, op for op.
  m.def(
      "set_compile_fusion",
      [](bool fuse) {
        mx::set_compile_mode(fuse ? mx::CompileMode::enabled : mx::CompileMode::no_fuse);
      },
      "fuse"_a,
      "Whether mx.compile fuses element-wise ops in the traces it makes from now on (MLX's "
      "compile mode enabled or no_fuse).");
}

// Runtime choice of the kernel path: the widest the CPU has, unless a test forces another.
#include <atomic>

#include "kernels.h"

namespace mas {
namespace {

bool detect(Isa isa) {
#if MAS_X86
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi2");
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
    case Isa::scalar:
      return true;
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

Isa best() {
  if (detect(Isa::avx512)) return Isa::avx512;
  if (detect(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

std::atomic<Isa> g_isa{best()};

}  // namespace

bool cpu_has(Isa isa) { return detect(isa); }
Isa current_isa() { return g_isa.load(); }
void select_isa(Isa isa) { g_isa.store(isa); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    case Isa::scalar:
      return "scalar";
  }
  return "?";
}

// Each kernel's entry point runs the path in use: one definition per kernel.
#if MAS_X86
#define MAS_BY_ISA(fn, Args)                     \
  void fn(const Args& a) {                       \
    switch (g_isa.load()) {                      \
      case Isa::avx512:                          \
        return avx512::fn(a);                    \
      case Isa::avx2:                            \
        return avx2::fn(a);                      \
      default:                                   \
        return scalar::fn(a);                    \
    }                                            \
  }
#else
#define MAS_BY_ISA(fn, Args) \
  void fn(const Args& a) { scalar::fn(a); }
#endif

MAS_BY_ISA(qmm, QmmArgs)
MAS_BY_ISA(bf16mm, Bf16Args)
MAS_BY_ISA(f32mm, F32Args)
MAS_BY_ISA(attention, AttnArgs)
MAS_BY_ISA(gated_delta, DeltaArgs)
MAS_BY_ISA(conv_values, ConvArgs)
MAS_BY_ISA(silu_values, ActArgs)
MAS_BY_ISA(softmax_rows, SoftmaxArgs)
MAS_BY_ISA(categorical_rows, CatArgs)
MAS_BY_ISA(argmax_rows, ArgmaxArgs)
MAS_BY_ISA(filter_floor_rows, FloorArgs)

#undef MAS_BY_ISA

namespace {
#if MAS_X86
const bool g_vnni = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
#else
const bool g_vnni = false;
#endif

// The AVX-512 path's head needs VNNI too (vpdpbusd); without it, AVX2's.
Isa head_path() {
  const Isa isa = g_isa.load();
  return isa == Isa::avx512 && !g_vnni ? Isa::avx2 : isa;
}
}  // namespace

int head_x_levels() { return head_path() == Isa::avx2 ? 63 : 127; }

void head(const HeadArgs& a) {
  switch (head_path()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::head(a);
    case Isa::avx2:
      return avx2::head(a);
#endif
    default:
      return scalar::head(a);
  }
}

void qhead(const QHeadArgs& a) {
  switch (head_path()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::qhead(a);
    case Isa::avx2:
      return avx2::qhead(a);
#endif
    default:
      return scalar::qhead(a);
  }
}

bool qhead_fast() { return head_path() != Isa::scalar; }

bool qhead_half_table() { return head_path() == Isa::avx2; }

}  // namespace mas

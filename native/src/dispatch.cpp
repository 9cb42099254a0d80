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

void qmm(const QmmArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::qmm(a);
    case Isa::avx2:
      return avx2::qmm(a);
#endif
    default:
      return scalar::qmm(a);
  }
}

void bf16mm(const Bf16Args& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::bf16mm(a);
    case Isa::avx2:
      return avx2::bf16mm(a);
#endif
    default:
      return scalar::bf16mm(a);
  }
}

void f32mm(const F32Args& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::f32mm(a);
    case Isa::avx2:
      return avx2::f32mm(a);
#endif
    default:
      return scalar::f32mm(a);
  }
}

void attention(const AttnArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::attention(a);
    case Isa::avx2:
      return avx2::attention(a);
#endif
    default:
      return scalar::attention(a);
  }
}

void gated_delta(const DeltaArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::gated_delta(a);
    case Isa::avx2:
      return avx2::gated_delta(a);
#endif
    default:
      return scalar::gated_delta(a);
  }
}

void conv_values(const ConvArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::conv_values(a);
    case Isa::avx2:
      return avx2::conv_values(a);
#endif
    default:
      return scalar::conv_values(a);
  }
}

void silu_values(const ActArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::silu_values(a);
    case Isa::avx2:
      return avx2::silu_values(a);
#endif
    default:
      return scalar::silu_values(a);
  }
}

void softmax_rows(const SoftmaxArgs& a) {
  switch (g_isa.load()) {
#if MAS_X86
    case Isa::avx512:
      return avx512::softmax_rows(a);
    case Isa::avx2:
      return avx2::softmax_rows(a);
#endif
    default:
      return scalar::softmax_rows(a);
  }
}

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

}  // namespace mas

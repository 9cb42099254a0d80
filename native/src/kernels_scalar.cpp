// Portable path: each weight row is widened to float32 once, then dotted with every x row.
// Compiled with the baseline flags only; the reference the fast paths are tested against.
#include <cstring>

#include "kernels.h"
#include "mlx_math.h"

namespace mas::scalar {
namespace {

float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400) == 0);
    u = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float load_scale(const void* p, ScaleType st, int64_t i) {
  switch (st) {
    case ScaleType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) s[j] += a[k + j] * b[k + j];
  }
  for (; k < n; ++k) s[k & 7] += a[k] * b[k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

constexpr int64_t kRowsPerTask = 16;

struct QmmJob {
  const QmmArgs* a;
};

void qmm_task(void* ctx, int64_t task) {
  const QmmArgs& a = *static_cast<QmmJob*>(ctx)->a;
  const int64_t K = a.K, groups = K / a.group_size;
  const int64_t words_per_row = K * a.bits / 32;
  const uint32_t mask = (1u << a.bits) - 1;
  const int per_word = 32 / a.bits;
  float* row = thread_buffer(1, static_cast<size_t>(K));
  const int64_t n1 = (task + 1) * kRowsPerTask < a.N ? (task + 1) * kRowsPerTask : a.N;
  for (int64_t n = task * kRowsPerTask; n < n1; ++n) {
    const uint32_t* w = a.w + n * words_per_row;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = load_scale(a.scales, a.st, n * groups + g);
      const float b = load_scale(a.biases, a.st, n * groups + g);
      for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; ++k) {
        const uint32_t q = (w[k / per_word] >> (a.bits * (k % per_word))) & mask;
        row[k] = s * static_cast<float>(q) + b;
      }
    }
    for (int64_t m = 0; m < a.M; ++m) a.out[m * a.N + n] = dot(a.x + m * K, row, K);
  }
}

struct Bf16Job {
  const Bf16Args* a;
};

void bf16_task(void* ctx, int64_t task) {
  const Bf16Args& a = *static_cast<Bf16Job*>(ctx)->a;
  float* row = thread_buffer(1, static_cast<size_t>(a.K));
  const int64_t n1 = (task + 1) * kRowsPerTask < a.N ? (task + 1) * kRowsPerTask : a.N;
  for (int64_t n = task * kRowsPerTask; n < n1; ++n) {
    for (int64_t k = 0; k < a.K; ++k) row[k] = bf16_to_f32(a.w[n * a.K + k]);
    for (int64_t m = 0; m < a.M; ++m) a.out[m * a.N + n] = dot(a.x + m * a.K, row, a.K);
  }
}

struct F32Job {
  const F32Args* a;
};

void f32_task(void* ctx, int64_t task) {
  const F32Args& a = *static_cast<F32Job*>(ctx)->a;
  const int64_t n1 = (task + 1) * kRowsPerTask < a.N ? (task + 1) * kRowsPerTask : a.N;
  for (int64_t n = task * kRowsPerTask; n < n1; ++n) {
    for (int64_t m = 0; m < a.M; ++m) a.out[m * a.N + n] = dot(a.x + m * a.K, a.w + n * a.K, a.K);
  }
}

}  // namespace

void qmm(const QmmArgs& a) {
  QmmJob job{&a};
  parallel_for((a.N + kRowsPerTask - 1) / kRowsPerTask, qmm_task, &job);
}

void bf16mm(const Bf16Args& a) {
  Bf16Job job{&a};
  parallel_for((a.N + kRowsPerTask - 1) / kRowsPerTask, bf16_task, &job);
}

void f32mm(const F32Args& a) {
  F32Job job{&a};
  parallel_for((a.N + kRowsPerTask - 1) / kRowsPerTask, f32_task, &job);
}

#include "attention.inc"
#include "gated_delta.inc"
#include "activation.inc"
#include "head.inc"

namespace {

void head_task(void* ctx, int64_t task) {
  const HeadArgs& a = *static_cast<const HeadArgs*>(ctx);
  head_run<1>(a, task, [&a](const uint8_t* const* rows, int64_t m0, int, int32_t* out,
                            const uint8_t*) {
    const int8_t* xr = a.x + m0 * a.Kp;
    for (int64_t j = 0; j < kHeadTile; ++j) {
      int32_t sum = 0;
      for (int64_t k = 0; k < a.Kp; ++k) sum += int32_t{rows[j][k]} * int32_t{xr[k]};
      out[j] = sum;
    }
  });
}

}  // namespace

void head(const HeadArgs& a) {
  parallel_for((a.N + a.rows_per_task - 1) / a.rows_per_task, head_task,
               const_cast<HeadArgs*>(&a));
}

}  // namespace mas::scalar

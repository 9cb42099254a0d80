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
#include "sampling.inc"
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

// The quantized head from the packed words as they are: per row, group by group, the
// integer products, then scale and bias in float32 (the order AVX-512's lanes keep).
void qhead_task(void* ctx, int64_t task) {
  const QHeadArgs& q = *static_cast<const QHeadArgs*>(ctx);
  const uint32_t* block[kHeadTile];
  int64_t base = 0;
  const int per_word = 32 / q.bits, words = q.group_size / per_word;
  const uint32_t mask = (1u << q.bits) - 1u;
  qhead_run<1>(
      q, task,
      [&](int64_t n0, const uint32_t* const* rows) {
        base = n0;
        for (int j = 0; j < kHeadTile; ++j) block[j] = rows[j];
      },
      [&](int64_t m0, int, float* out) {
        const int8_t* xr = q.h.x + m0 * q.h.Kp;
        const float* xsum = q.xsum + m0 * q.G;
        const float* tab = q.table + (base / kHeadTile) * q.G * 32;
        for (int j = 0; j < kHeadTile; ++j) {
          float acc = 0.0f;
          for (int64_t g = 0; g < q.G; ++g) {
            int32_t dot = 0;
            for (int64_t d = g * words; d < (g + 1) * words; ++d) {
              const uint32_t word = block[j][d];
              for (int e = 0; e < per_word; ++e) {
                // x's byte for value e of word d: 4-bit words pair the low nibbles of their
                // bytes with x's first four bytes of the run, the high ones with the last.
                const int64_t at = q.bits == 4 ? 8 * d + (e & 1) * 4 + (e >> 1) : 4 * d + e;
                dot += static_cast<int32_t>((word >> (q.bits * e)) & mask) * xr[at];
              }
            }
            acc = __builtin_fmaf(static_cast<float>(dot), tab[g * 32 + j], acc);
            acc = __builtin_fmaf(tab[g * 32 + 16 + j], xsum[g], acc);
          }
          out[j] = acc * q.h.xscale[m0];
        }
      });
}

}  // namespace

void head(const HeadArgs& a) {
  parallel_for((a.N + a.rows_per_task - 1) / a.rows_per_task, head_task,
               const_cast<HeadArgs*>(&a));
}

void qhead(const QHeadArgs& a) {
  parallel_for((a.h.N + a.h.rows_per_task - 1) / a.h.rows_per_task, qhead_task,
               const_cast<QHeadArgs*>(&a));
}

}  // namespace mas::scalar

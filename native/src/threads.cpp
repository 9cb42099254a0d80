// A small thread pool for splitting a product's rows across cores.
//
// The calling thread (MLX's stream thread) always takes part and tasks are claimed one at a
// time from a shared counter, so a worker that wakes late (its core busy with another
// library's spinning thread) costs nothing: the caller simply takes more tasks. The caller
// waits only for tasks already claimed, and sleeps rather than spins if that takes more than
// a few microseconds. Idle workers spin about 60 us, then sleep on a futex.
//
// Measured on the 2-core box (native/bench.py --layers: decode steps of 8 layers mixing our
// 4-bit products with MKL float32 matmuls): 2 threads vs 1, quiet machine: 23.6 vs 34.6 ms per
// step at 1 row, 122-140 vs 192 ms at 16 rows; a 700 us worker spin was worst under load.
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MAS_PAUSE() _mm_pause()
#else
#define MAS_PAUSE() ((void)0)
#endif

namespace mas {
namespace {

// How long an idle worker polls for the next job before sleeping, in pause loops (~35 ns each
// on recent x86): about 60 us, enough to bridge the gap between two layers' products.
std::atomic<int> g_spin_loops{2000};
// How long the caller polls for a worker's last task before sleeping (~10 us).
constexpr int kFinishSpinLoops = 300;

// Raw futex calls on 32-bit counters (libstdc++ 12's atomic wait/notify can lose a wake-up).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t ntasks;
  std::atomic<int64_t> next{0};
};

// The CPUs the workers may run on (set_worker_cpus); empty: wherever their creator may.
std::vector<int> g_worker_cpus;

void pin_thread(std::thread& t, const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
}

struct Pool {
  explicit Pool(int nworkers) {
    for (int i = 0; i < nworkers; ++i) {
      threads.emplace_back([this] { work(0); });  // gen is 0 until the first job
      // A new thread runs where its creator may: the pool is made by the first caller with
      // two tasks, MLX's stream thread, which the runner may have pinned to a core of its own.
      pin_thread(threads.back(), g_worker_cpus);
    }
  }

  // Stop and join the workers.
  void shutdown() {
    stop.store(true);
    gen.fetch_add(1);
    futex_wake_all(&gen);
    for (auto& t : threads) t.join();
    threads.clear();
  }

  // `seen`: the generation this worker has handled. A worker that starts late still sees any
  // job or shutdown published since the pool was built.
  void work(uint32_t seen) {
    while (true) {
      const int spin = g_spin_loops.load(std::memory_order_relaxed);
      for (int i = 0; i < spin && gen.load(std::memory_order_acquire) == seen; ++i) MAS_PAUSE();
      while (gen.load(std::memory_order_acquire) == seen && !stop.load()) {
        sleepers.fetch_add(1);
        if (gen.load() == seen) futex_wait(&gen, seen);
        sleepers.fetch_sub(1);
      }
      seen = gen.load(std::memory_order_acquire);
      if (stop.load()) return;
      inflight.fetch_add(1);
      Job* job = current.load();
      if (job != nullptr) {
        for (int64_t t; (t = job->next.fetch_add(1)) < job->ntasks;) job->fn(job->ctx, t);
      }
      inflight.fetch_sub(1);
      if (caller_waiting.load() != 0) futex_wake_all(&inflight);
    }
  }

  void run(Job& job) {
    current.store(&job);
    gen.fetch_add(1);  // seq_cst: pairs with the worker's sleepers / gen check
    if (sleepers.load() > 0) futex_wake_all(&gen);
    for (int64_t t; (t = job.next.fetch_add(1)) < job.ntasks;) job.fn(job.ctx, t);
    current.store(nullptr);
    // A worker that loaded `current` before the store above counted itself in `inflight`
    // first (both seq_cst), so it is waited for; later ones see nullptr. Spin briefly, then
    // sleep: if the worker was preempted mid-task, this core going idle lets the kernel move
    // it here instead of leaving it queued behind another process until its slice ends.
    for (int i = 0; i < kFinishSpinLoops; ++i) {
      if (inflight.load(std::memory_order_acquire) == 0) return;
      MAS_PAUSE();
    }
    caller_waiting.store(1);
    for (uint32_t v; (v = inflight.load()) != 0;) futex_wait(&inflight, v);
    caller_waiting.store(0);
  }

  std::vector<std::thread> threads;
  std::atomic<uint32_t> gen{0};
  std::atomic<int> sleepers{0};
  std::atomic<uint32_t> inflight{0};
  std::atomic<int> caller_waiting{0};
  std::atomic<Job*> current{nullptr};
  std::atomic<bool> stop{false};
  std::mutex busy;  // one job at a time; a second caller runs its job inline
};

std::mutex g_config;
Pool* g_pool = nullptr;  // leaked on purpose: no joins during interpreter shutdown
int g_threads = 0;       // 0: not configured yet

void after_fork_in_child() {
  // The workers did not survive fork(); forget them (never join threads that do not exist).
  g_pool = nullptr;
  g_threads = 0;
}

Pool* pool_for_caller() {
  std::lock_guard<std::mutex> lock(g_config);
  if (g_threads == 0) {
    static bool registered = false;
    if (!registered) {
      pthread_atfork(nullptr, nullptr, after_fork_in_child);
      registered = true;
    }
    g_threads = default_num_threads();
  }
  if (g_threads > 1 && g_pool == nullptr) g_pool = new Pool(g_threads - 1);
  return g_threads > 1 ? g_pool : nullptr;
}

}  // namespace

int default_num_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

void set_spin_loops(int n) { g_spin_loops.store(n < 0 ? 0 : n); }

void set_worker_cpus(const std::vector<int>& cpus) {
  std::lock_guard<std::mutex> lock(g_config);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE) {
      throw std::invalid_argument("set_worker_cpus: there is no CPU " + std::to_string(c));
    }
  }
  g_worker_cpus = cpus;
  if (g_pool == nullptr) return;
  for (auto& t : g_pool->threads) pin_thread(t, cpus);
}

int num_threads() {
  std::lock_guard<std::mutex> lock(g_config);
  return g_threads == 0 ? default_num_threads() : g_threads;
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(g_config);
  if (n == g_threads) return;
  if (g_pool != nullptr) {
    std::lock_guard<std::mutex> busy(g_pool->busy);  // wait for a running job
    g_pool->shutdown();
    g_pool = nullptr;  // leaked: a caller may still hold it, and then runs its job inline
  }
  g_threads = n < 1 ? 1 : n;
}

void parallel_for(int64_t ntasks, void (*fn)(void*, int64_t), void* ctx) {
  Pool* pool = ntasks > 1 ? pool_for_caller() : nullptr;
  std::unique_lock<std::mutex> lock;
  if (pool != nullptr) lock = std::unique_lock<std::mutex>(pool->busy, std::try_to_lock);
  if (pool == nullptr || !lock.owns_lock()) {
    for (int64_t t = 0; t < ntasks; ++t) fn(ctx, t);
    return;
  }
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.ntasks = ntasks;
  pool->run(job);
}

namespace {
struct Buffer {
  float* data = nullptr;
  size_t floats = 0;
  ~Buffer() { std::free(data); }
};
constexpr int kSlots = 4;
thread_local Buffer t_buffers[kSlots];
}  // namespace

float* thread_buffer(int slot, size_t floats) {
  Buffer& b = t_buffers[slot];
  if (b.floats < floats) {
    std::free(b.data);
    size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
    b.data = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (b.data == nullptr) {
      b.floats = 0;
      throw std::bad_alloc();
    }
    b.floats = floats;
  }
  return b.data;
}

void trim_thread_buffer(int slot, size_t keep_floats) {
  Buffer& b = t_buffers[slot];
  if (b.floats > keep_floats) {
    std::free(b.data);
    b.data = nullptr;
    b.floats = 0;
  }
}

}  // namespace mas

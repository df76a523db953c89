#include "pool.h"

#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLXCEL_PAUSE() _mm_pause()
#else
#define MLXCEL_PAUSE() ((void)0)
#endif

namespace mlxcel_native {
namespace {

// How long an idle worker polls before sleeping (MLXCEL_NATIVE_SPIN_US overrides it). Short:
// only large calls use the worker (see ops.cpp), and a polling worker takes a core from mlx's
// main thread, which encodes the graph while the stream computes. Measured on SmolLM2-135M
// decode with every call >= 64k MACs threaded: 2000 us 56 ms/step, 200 us 45, 0 us 39; with
// only >= 4M-MAC calls threaded, 0/50/200 us were within noise (31-39 ms).
std::chrono::microseconds spin_time() {
  if (const char* env = std::getenv("MLXCEL_NATIVE_SPIN_US")) {
    const int us = std::atoi(env);
    if (us >= 0) return std::chrono::microseconds(us);
  }
  return std::chrono::microseconds(50);
}

int read_int(const std::string& path) {
  std::ifstream f(path);
  int v = -1;
  f >> v;
  return f ? v : -1;
}

// Physical cores among the CPUs this process may run on (SMT siblings count once): two
// threads on one core's siblings would share its FMA units and gain nothing.
int physical_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  std::set<std::pair<int, int>> cores;
  int cpus = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    ++cpus;
    const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    const int pkg = read_int(topo + "physical_package_id");
    const int core = read_int(topo + "core_id");
    cores.insert(core < 0 ? std::make_pair(-1, cpu) : std::make_pair(pkg, core));
  }
  return cores.empty() ? (cpus > 0 ? cpus : 1) : int(cores.size());
}

int configured_threads() {
  if (const char* env = std::getenv("MLXCEL_NATIVE_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return physical_cores();
}

}  // namespace

Pool& Pool::instance() {
  // Never destroyed: joining threads during static destruction at exit buys nothing and
  // races with other libraries' teardown (mlx's scheduler among them).
  static Pool* pool = new Pool(configured_threads());
  return *pool;
}

Pool::Pool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker(); });
}

Pool::~Pool() {
  stop_.store(true);
  wake_.fetch_add(1);
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::run(int n_tasks, const std::function<void(int)>& fn) {
  if (n_tasks <= 0) return;
  if (n_tasks == 1 || workers_.empty()) {
    for (int i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> lock(run_mutex_);
  const uint32_t job = ++job_;
  Slot& slot = slots_[job & 1];
  slot.fn.store(&fn, std::memory_order_relaxed);
  slot.n_tasks.store(n_tasks, std::memory_order_relaxed);
  slot.remaining.store(n_tasks, std::memory_order_relaxed);
  state_.store(uint64_t(job) << 32, std::memory_order_release);
  wake_.store(job, std::memory_order_release);
  wake_.notify_all();
  work_on(job);
  // The others' tasks are about as long as ours: poll briefly before sleeping.
  int r;
  for (int i = 0; (r = slot.remaining.load(std::memory_order_acquire)) != 0; ++i) {
    if (i < 20000) {
      MLXCEL_PAUSE();
    } else {
      slot.remaining.wait(r, std::memory_order_acquire);
    }
  }
}

void Pool::work_on(uint32_t job) {
  Slot& slot = slots_[job & 1];
  uint64_t st = state_.load(std::memory_order_acquire);
  while (uint32_t(st >> 32) == job) {
    // n_tasks may belong to a later job if ours is over; then the CAS below fails anyway,
    // since that job's id is in state_ before its slot can be reused.
    const uint32_t idx = uint32_t(st);
    if (idx >= uint32_t(slot.n_tasks.load(std::memory_order_relaxed))) return;
    if (!state_.compare_exchange_weak(st, st + 1, std::memory_order_acq_rel)) continue;
    (*slot.fn.load(std::memory_order_relaxed))(int(idx));
    if (slot.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) slot.remaining.notify_all();
    st = state_.load(std::memory_order_acquire);
  }
}

void Pool::worker() {
  const auto spin = spin_time();
  uint32_t seen = 0;
  while (true) {
    uint32_t job = wake_.load(std::memory_order_acquire);
    if (job == seen) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 1; (job = wake_.load(std::memory_order_acquire)) == seen; ++i) {
        MLXCEL_PAUSE();
        if (i % 64 == 0 && std::chrono::steady_clock::now() - start > spin) break;
      }
      if (job == seen) {
        wake_.wait(seen, std::memory_order_acquire);
        continue;
      }
    }
    if (stop_.load()) return;
    seen = job;
    work_on(job);
  }
}

}  // namespace mlxcel_native

// A small persistent thread pool for splitting one matmul's output columns. A decode step makes
// ~200 calls of 10-100 us each, so threads are created once; idle workers poll for 50 us and
// then sleep on a futex, so they never hold a core that mlx's main thread, OpenBLAS or Python
// needs for long.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxcel_native {

class Pool {
 public:
  // The process-wide pool: MLXCEL_NATIVE_THREADS threads (calling thread included), else one
  // per physical core this process may run on.
  static Pool& instance();

  explicit Pool(int threads);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const {
    return int(workers_.size()) + 1;
  }

  // Runs fn(0) .. fn(n_tasks - 1) on the pool and the calling thread; returns when all are done.
  void run(int n_tasks, const std::function<void(int)>& fn);

 private:
  // A job lives in one of two slots (by job id parity) so a worker that read a finished job's
  // id late can never claim a task of the job being set up: claims are a compare-and-swap on
  // state_ (job id << 32 | next task index), which fails once the id moved on.
  struct Slot {
    std::atomic<const std::function<void(int)>*> fn{nullptr};
    std::atomic<int> n_tasks{0};
    std::atomic<int> remaining{0};
  };

  void worker();
  void work_on(uint32_t job);

  std::vector<std::thread> workers_;
  Slot slots_[2];
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> wake_{0};  // the latest job id; workers sleep on it
  std::atomic<bool> stop_{false};
  std::mutex run_mutex_;  // mlx may evaluate on several CPU streams: one job at a time
  uint32_t job_ = 0;
};

}  // namespace mlxcel_native

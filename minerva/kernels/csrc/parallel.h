// A parallel for that never waits for a thread that has not started.
//
// Fork-join loops (OpenMP, at::parallel_for) split a range into one share per thread and
// end with a barrier: when another process takes a core, the thread that lost it holds
// every call up for a scheduler time slice, and a decode step makes hundreds of calls
// (measured here: 2 threads fell from ~200 to ~10 tokens/s while other jobs ran, and one
// thread kept ~120). Here the range is cut into chunks taken from a shared counter by the
// caller and by whichever helper threads are awake; the caller waits only for chunks in
// progress, so a helper that is off its core costs nothing, and the caller finishes alone
// if need be. Helpers spin briefly between calls, then sleep.
//
// A helper that loses its core in the middle of a chunk still delays the caller. When
// that keeps happening (other processes want the cores), calls run on the caller alone
// for a while, then try the helpers again: on a busy machine one thread is far faster
// than threads that wait for each other. The while is a time, 20 ms at first and twice
// as long each time the helpers stall again, up to 2 s; a window without stalls resets
// it. (It was 4096 calls: page faults on a fresh model's first prefill read as stalls,
// and the next eight 512-token prefills of the 1.1B shape then ran on one thread, at
// half speed.)
//
// Which thread computes a chunk never changes its result: every kernel computes each of
// its items in a fixed order on its own.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace minerva {

class ThreadPool {
 public:
  // Threads for the kernels (the caller included); 0 = torch's setting. Set apart from
  // torch's so the engine can run torch's own small ops on one thread (see runner.py).
  void set_threads(int n) { wanted_.store(std::max(0, n)); }

  // Counts since the process started, for the engine's metrics: calls run on the helpers
  // too, calls run on the caller alone while backed off, waits judged stalls, back-offs.
  struct Stats {
    int64_t parallel, serial_backed_off, stalls, backoffs;
  };
  Stats stats() const {
    return {parallel_.load(std::memory_order_relaxed), backed_off_.load(std::memory_order_relaxed),
            stall_count_.load(std::memory_order_relaxed), backoff_count_.load(std::memory_order_relaxed)};
  }

  static ThreadPool& get() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: helpers may still sleep at exit
    return *pool;
  }

  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int wanted = wanted_.load(std::memory_order_relaxed);
    const int threads = wanted > 0 ? wanted : at::get_num_threads();
    thread_local bool inside = false;  // a nested call, or one from a helper, runs serially
    if (threads <= 1 || n <= grain || inside) return f(begin, end);
    if (now_ns() < serial_until_.load(std::memory_order_relaxed)) {
      backed_off_.fetch_add(1, std::memory_order_relaxed);
      return f(begin, end);
    }
    if (!busy_.try_lock()) return f(begin, end);
    std::lock_guard<std::mutex> hold(busy_, std::adopt_lock);
    parallel_.fetch_add(1, std::memory_order_relaxed);
    ensure(threads - 1);
    Job job;
    job.fn = [](const void* ctx, int64_t lo, int64_t hi) { (*static_cast<const F*>(ctx))(lo, hi); };
    job.ctx = &f;
    job.begin = begin;
    job.end = end;
    // several chunks per thread, so the awake threads can take over a sleeping one's share
    job.chunk = std::max<int64_t>(grain, (n + 4 * threads - 1) / (4 * threads));
    job.left.store((n + job.chunk - 1) / job.chunk, std::memory_order_relaxed);
    job.helpers = threads - 1;
    job_.store(&job);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) gen_.notify_all();
    inside = true;
    const auto started = std::chrono::steady_clock::now();
    const int64_t mine = work(job);
    inside = false;
    const auto waiting = std::chrono::steady_clock::now();
    for (int spins = 0; job.left.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
    // A helper may have just started its last chunk: waiting up to about one chunk is normal.
    if (mine > 0) note_wait(std::chrono::steady_clock::now() - waiting, (waiting - started) / mine);
    job_.store(nullptr);
    while (users_.load() > 0) _mm_pause();  // a helper between taking the job and seeing it done
  }

 private:
  struct Job {
    void (*fn)(const void*, int64_t, int64_t);
    const void* ctx;
    int64_t begin, end, chunk;
    int helpers;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> left{0};
  };

  // Waiting much longer than a chunk takes (chunks differ: causal attention rows grow) and
  // longer than anything but a lost core would explain means a helper lost its core mid-chunk.
  static constexpr auto kFloor = std::chrono::microseconds(500);
  static constexpr int kWindow = 64, kStallsToBackOff = 4;
  static constexpr int64_t kBackOffFirst = 20'000'000, kBackOffMost = 2'000'000'000;  // ns

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void note_wait(std::chrono::steady_clock::duration waited, std::chrono::steady_clock::duration chunk) {
    const bool stalled = waited > std::max<std::chrono::steady_clock::duration>(4 * chunk, kFloor);
    stalls_ += stalled;
    if (stalled) stall_count_.fetch_add(1, std::memory_order_relaxed);
    if (++calls_ < kWindow) return;
    if (stalls_ >= kStallsToBackOff) {
      serial_until_.store(now_ns() + back_off_, std::memory_order_relaxed);
      back_off_ = std::min(2 * back_off_, kBackOffMost);
      backoff_count_.fetch_add(1, std::memory_order_relaxed);
    } else {
      back_off_ = kBackOffFirst;
    }
    calls_ = stalls_ = 0;
  }

  static int64_t work(Job& j) {  // returns how many chunks this thread computed
    for (int64_t done = 0;; ++done) {
      const int64_t lo = j.begin + j.next.fetch_add(1, std::memory_order_relaxed) * j.chunk;
      if (lo >= j.end) return done;
      j.fn(j.ctx, lo, std::min(lo + j.chunk, j.end));
      j.left.fetch_sub(1, std::memory_order_release);
    }
  }

  void ensure(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { helper(index); });
      threads_.back().detach();
    }
  }

  void helper(int index) {
    uint32_t seen = gen_.load();
    for (;;) {
      for (int i = 0; i < 20000 && gen_.load(std::memory_order_acquire) == seen; ++i) _mm_pause();
      if (gen_.load() == seen) {
        sleepers_.fetch_add(1);
        gen_.wait(seen);
        sleepers_.fetch_sub(1);
      }
      seen = gen_.load();
      users_.fetch_add(1);
      Job* j = job_.load();
      if (j != nullptr && index < j->helpers) work(*j);
      users_.fetch_sub(1);
    }
  }

  std::mutex busy_;  // one parallel call at a time; a concurrent caller runs serially
  std::vector<std::thread> threads_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> users_{0}, sleepers_{0};
  std::atomic<int> wanted_{0};
  std::atomic<int64_t> serial_until_{0};  // now_ns() before which calls run on the caller alone
  int64_t back_off_ = kBackOffFirst;      // how long the next back-off lasts
  int calls_ = 0, stalls_ = 0;       // over the current window of parallel calls
  std::atomic<int64_t> parallel_{0}, backed_off_{0}, stall_count_{0}, backoff_count_{0};  // Stats
};

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  ThreadPool::get().run(begin, end, grain, f);
}

}  // namespace minerva

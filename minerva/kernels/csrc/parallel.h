// A parallel for that never waits for a thread that has not started.
//
// Fork-join loops (OpenMP, at::parallel_for) split a range into one share per thread and
// end with a barrier: when another process takes a core, the thread that lost it holds
// every call up for a scheduler time slice, and a decode step makes hundreds of calls
// (measured here: 2 threads fell from ~200 to ~10 tokens/s while other jobs ran, and one
// thread kept ~120). Here the range is cut into chunks that the caller and whichever helper
// threads are awake take; the caller waits only for chunks in progress, so a helper that is
// off its core costs nothing, and the caller finishes alone if need be. Helpers spin
// 2 ms between calls, then sleep.
//
// Each thread owns a run of consecutive chunks (a region) and takes them from its front;
// one that has run out takes the last chunk left in another's region. A thread thus reads
// one stretch of memory from start to end, stolen chunks aside, where chunks from a shared
// counter interleave the threads and every chunk starts a new stream for the prefetchers,
// which costs about a microsecond from memory. (Zen 4, 2 threads, greedy decode of the 1.1B
// Q4_K_M shape, 8 chunks a call, the two ways alternating in one process, runs grouped by a
// read-bandwidth probe taken with each: median step 12.76 -> 12.24 ms where the probe read
// 40-52 GB/s, 17.88 -> 17.67 ms at 26-40 GB/s; with one chunk per thread, 12.38 and 17.74.)
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
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace minerva {

class ThreadPool {
 public:
  // Inside parallel_for's f(lo, hi): the end of the run of consecutive items the calling
  // thread is on, an item >= hi up to which it goes on in order unless another thread takes
  // that work first (its region's end as it was when it took the chunk; hi for a chunk taken
  // from another's region). The one-row kernels bound their prefetches by it rather than by
  // hi, so that the next chunk of the region does not start cold. Intel Xeon with AMX, 2
  // threads, greedy decode, bounded by hi and by this alternating in one process (8 pairs
  // each): 1.1B Q4_0 shape 1.016x and 1.022x, Q2_K 1.025x, Q4_K_M 1.00x, 7B Q4_0 1.006x,
  // Gemma 3 270M 1.022x, SmolLM2 135M 1.05x.
  static int64_t run_end(int64_t hi) { return std::max(hi, run_end_); }

  // Threads for the kernels (the caller included); 0 = torch's setting. Set apart from
  // torch's so the engine can run torch's own small ops on one thread (see runner.py).
  void set_threads(int n) { wanted_.store(std::max(0, n)); }
  int threads() const {
    const int wanted = wanted_.load(std::memory_order_relaxed);
    return wanted > 0 ? wanted : at::get_num_threads();
  }

  // Counts since the process started, for the engine's metrics: calls run on the helpers
  // too, calls run on the caller alone while backed off, waits judged stalls, back-offs, and
  // the nanoseconds callers spent waiting for helpers after their own chunks.
  struct Stats {
    int64_t parallel, serial_backed_off, stalls, backoffs, wait_ns;
  };
  Stats stats() const {
    return {parallel_.load(std::memory_order_relaxed), backed_off_.load(std::memory_order_relaxed),
            stall_count_.load(std::memory_order_relaxed), backoff_count_.load(std::memory_order_relaxed),
            wait_ns_.load(std::memory_order_relaxed)};
  }

  static ThreadPool& get() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: helpers may still sleep at exit
    return *pool;
  }

  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int threads = this->threads();
    thread_local bool inside = false;  // a nested call, or one from a helper, runs serially
    if (threads <= 1 || n <= grain || inside) return serial(begin, end, f);
    if (now_ns() < serial_until_.load(std::memory_order_relaxed)) {
      backed_off_.fetch_add(1, std::memory_order_relaxed);
      return serial(begin, end, f);
    }
    if (!busy_.try_lock()) return serial(begin, end, f);
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
    const int64_t chunks = (n + job.chunk - 1) / job.chunk;
    job.left.store(chunks, std::memory_order_relaxed);
    job.helpers = threads - 1;
    job.regions = regions_.get();
    for (int r = 0; r < threads; ++r)
      regions_[r].span.store(Region::pack(chunks * r / threads, chunks * (r + 1) / threads), std::memory_order_relaxed);
    job_.store(&job);
    gen_.fetch_add(1);
    if (sleepers_.load() > 0) gen_.notify_all();
    inside = true;
    const auto started = std::chrono::steady_clock::now();
    const int64_t mine = work(job, 0);
    inside = false;
    const auto waiting = std::chrono::steady_clock::now();
    for (int spins = 0; job.left.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
    const auto waited = std::chrono::steady_clock::now() - waiting;
    wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(), std::memory_order_relaxed);
    // A helper may have just started its last chunk: waiting up to about one chunk is normal.
    if (mine > 0) note_wait(waited, (waiting - started) / mine);
    job_.store(nullptr);
    while (users_.load() > 0) _mm_pause();  // a helper between taking the job and seeing it done
  }

 private:
  inline static thread_local int64_t run_end_ = 0;  // run_end's, for the f(lo, hi) in progress

  template <typename F>
  static void serial(int64_t begin, int64_t end, const F& f) {
    const int64_t was = run_end_;
    run_end_ = end;
    f(begin, end);
    run_end_ = was;
  }

  // A thread's chunks [next, end), taken from the front by their owner and from the back by
  // the others; a line of its own, as every thread takes from its own all the time.
  struct alignas(64) Region {
    std::atomic<uint64_t> span{0};  // next | end << 32
    static uint64_t pack(int64_t next, int64_t end) { return uint64_t(next) | uint64_t(end) << 32; }
    // the chunk taken (its owner: from the front), or -1 when none is left; *last: the
    // region's last chunk as it was then (the owner's run goes on to it)
    int64_t take(bool front, int64_t* last) {
      uint64_t v = span.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t next = v & 0xffffffffu, end = v >> 32;
        if (next >= end) return -1;
        if (span.compare_exchange_weak(v, front ? v + 1 : v - (uint64_t(1) << 32), std::memory_order_relaxed)) {
          *last = static_cast<int64_t>(end - 1);
          return static_cast<int64_t>(front ? next : end - 1);
        }
      }
    }
  };

  struct Job {
    void (*fn)(const void*, int64_t, int64_t);
    const void* ctx;
    int64_t begin, end, chunk;
    int helpers;
    Region* regions;  // one per thread, the caller's first
    std::atomic<int64_t> left{0};
  };

  // Waiting much longer than a chunk takes (chunks differ: causal attention rows grow) and
  // longer than anything but a lost core would explain means a helper lost its core mid-chunk.
  static constexpr auto kFloor = std::chrono::microseconds(500);
  static constexpr int kWindow = 64, kStallsToBackOff = 4;
  static constexpr int64_t kSpinNs = 2'000'000;
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

  // Thread `self` (0: the caller) takes chunks from its region, then the others' last ones;
  // returns how many it computed.
  static int64_t work(Job& j, int self) {
    const int threads = j.helpers + 1;
    for (int64_t done = 0;; ++done) {
      int64_t last = 0;
      int64_t c = j.regions[self].take(true, &last);
      for (int r = 1; c < 0 && r < threads; ++r)
        if ((c = j.regions[(self + r) % threads].take(false, &last)) >= 0) last = c;
      if (c < 0) return done;
      const int64_t lo = j.begin + c * j.chunk;
      run_end_ = std::min(j.begin + (last + 1) * j.chunk, j.end);
      j.fn(j.ctx, lo, std::min(lo + j.chunk, j.end));
      j.left.fetch_sub(1, std::memory_order_release);
    }
  }

  void ensure(int helpers) {
    if (helpers + 1 > region_count_) {  // no job is out: the helpers touch regions only inside one
      regions_ = std::make_unique<Region[]>(helpers + 1);
      region_count_ = helpers + 1;
    }
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { helper(index); });
      threads_.back().detach();
    }
  }

  void helper(int index) {
    uint32_t seen = gen_.load();
    for (;;) {
      // spin kSpinNs before sleeping: through the Python between two decode steps of a 1.1B
      // model (~0.5 ms here), so the next step's first call finds the helper awake. (20000
      // pauses, ~530 us on Zen 4, had it asleep about then: the 1.1B Q4_K_M and Q6_K shapes'
      // greedy decode with ~2 ms of spinning, the two alternating in one process, 1.005x (83
      // of 132 pairs faster) and 1.017x (72 of 102).)
      const int64_t until = now_ns() + kSpinNs;
      for (int i = 1; gen_.load(std::memory_order_acquire) == seen; ++i) {
        _mm_pause();
        if (i % 64 == 0 && now_ns() > until) break;
      }
      if (gen_.load() == seen) {
        sleepers_.fetch_add(1);
        gen_.wait(seen);
        sleepers_.fetch_sub(1);
      }
      seen = gen_.load();
      users_.fetch_add(1);
      Job* j = job_.load();
      if (j != nullptr && index < j->helpers) work(*j, index + 1);
      users_.fetch_sub(1);
    }
  }

  std::mutex busy_;  // one parallel call at a time; a concurrent caller runs serially
  std::vector<std::thread> threads_;
  std::unique_ptr<Region[]> regions_;  // for the job out: one per thread
  int region_count_ = 0;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> users_{0}, sleepers_{0};
  std::atomic<int> wanted_{0};
  std::atomic<int64_t> serial_until_{0};  // now_ns() before which calls run on the caller alone
  int64_t back_off_ = kBackOffFirst;      // how long the next back-off lasts
  int calls_ = 0, stalls_ = 0;       // over the current window of parallel calls
  std::atomic<int64_t> parallel_{0}, backed_off_{0}, stall_count_{0}, backoff_count_{0}, wait_ns_{0};  // Stats
};

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  ThreadPool::get().run(begin, end, grain, f);
}

}  // namespace minerva

// The tensor-parallel ranks of one host exchange tensors through a shared memory segment
// (minerva/parallel/comm.py maps it; torch.distributed's gloo, over TCP, costs about 1 ms
// per all-reduce on a small VM, several times a decoder layer's own work at batch 1).
//
// Segment layout: one 64-byte line per rank holding the sequence number of the last
// exchange that rank has published, then two buffers of `world` slots of `slot_bytes`.
// An exchange s: each rank copies its part into its slot of buffer s % 2, publishes s
// (release), waits until every rank has published s (acquire), then reads what it needs.
// A rank starts writing exchange s + 2 (the same buffer) only after finishing s + 1,
// which every rank entered only after reading s: two buffers are enough.
//
// Waiting spins, then sleeps in growing steps (an idle server's workers wait for the next
// step this way); every 100 ms it checks that the peers' processes are alive, so a rank
// that dies ends the others' wait with an error instead of a hang. The GIL is released
// while waiting.
#pragma once

#include <signal.h>
#include <torch/extension.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace minerva {

class Exchange {
 public:
  Exchange(torch::Tensor segment, int64_t rank, int64_t world, int64_t slot_bytes, std::vector<int64_t> pids)
      : segment_(std::move(segment)), rank_(rank), world_(world), slot_(slot_bytes), pids_(std::move(pids)) {
    TORCH_CHECK(segment_.scalar_type() == torch::kUInt8 && segment_.is_contiguous(), "segment: contiguous uint8");
    TORCH_CHECK(segment_.numel() >= bytes_needed(world, slot_bytes), "segment too small");
    TORCH_CHECK(slot_bytes % 64 == 0 && slot_bytes >= 4096, "slot_bytes: a multiple of 64, at least 4096");
    base_ = segment_.data_ptr<uint8_t>();
  }

  static int64_t bytes_needed(int64_t world, int64_t slot_bytes) { return 64 * world + 2 * world * slot_bytes; }

  // t += every other rank's t, in place, summed in rank order (the same bits on every rank);
  // bfloat16 sums in float32 and rounds once.
  void all_reduce_(torch::Tensor t) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "all_reduce_: a contiguous CPU tensor");
    const bool bf16 = t.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || t.scalar_type() == torch::kFloat32, "all_reduce_: float32 or bfloat16");
    const int64_t size = t.element_size(), n = t.numel(), per = slot_ / size;
    auto* data = static_cast<uint8_t*>(t.data_ptr());
    py::gil_scoped_release nogil;
    for (int64_t lo = 0; lo < n || (n == 0 && lo == 0); lo += per) {
      const int64_t m = std::min(per, n - lo);
      const int64_t s = seq_ + 1;
      std::memcpy(slot(s, rank_), data + lo * size, m * size);
      publish_and_wait(s);
      if (bf16) {
        auto* out = reinterpret_cast<c10::BFloat16*>(data) + lo;
        std::vector<float> acc(m);
        for (int64_t r = 0; r < world_; ++r) {
          const auto* in = reinterpret_cast<const c10::BFloat16*>(slot(s, r));
          for (int64_t i = 0; i < m; ++i) acc[i] = r == 0 ? static_cast<float>(in[i]) : acc[i] + static_cast<float>(in[i]);
        }
        for (int64_t i = 0; i < m; ++i) out[i] = c10::BFloat16(acc[i]);
      } else {
        auto* out = reinterpret_cast<float*>(data) + lo;
        const auto* first = reinterpret_cast<const float*>(slot(s, 0));
        for (int64_t i = 0; i < m; ++i) out[i] = first[i];
        for (int64_t r = 1; r < world_; ++r) {
          const auto* in = reinterpret_cast<const float*>(slot(s, r));
          for (int64_t i = 0; i < m; ++i) out[i] += in[i];
        }
      }
      seq_ = s;
      if (n == 0) break;
    }
  }

  // Rank 0's int64 vector t to every rank (the other ranks pass an empty tensor); returns it.
  torch::Tensor broadcast(torch::Tensor t) {
    int64_t n = 0;
    if (rank_ == 0) {
      TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous(), "broadcast: int64 vector");
      n = t.numel();
    }
    const int64_t per = slot_ / 8 - 1;  // the first word of each chunk carries the total length
    torch::Tensor out = rank_ == 0 ? t : torch::Tensor();
    py::gil_scoped_release nogil;
    for (int64_t lo = 0;; lo += per) {
      const int64_t s = seq_ + 1;
      auto* words = reinterpret_cast<int64_t*>(slot(s, 0));
      if (rank_ == 0) {
        words[0] = n;
        std::memcpy(words + 1, t.data_ptr<int64_t>() + lo, std::min(per, n - lo) * 8);
      }
      publish_and_wait(s);
      if (rank_ != 0) {
        if (lo == 0) {
          n = words[0];
          out = torch::empty({n}, torch::kInt64);
        }
        std::memcpy(out.data_ptr<int64_t>() + lo, words + 1, std::min(per, n - lo) * 8);
      }
      seq_ = s;
      if (lo + per >= n) break;
    }
    return out;
  }

  // Every rank's t (the same shape and dtype on each) stacked [world, ...] on rank 0; an
  // empty tensor elsewhere.
  torch::Tensor gather(torch::Tensor t) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "gather: a contiguous CPU tensor");
    const int64_t bytes = t.numel() * t.element_size();
    torch::Tensor out;
    if (rank_ == 0) {
      auto shape = t.sizes().vec();
      shape.insert(shape.begin(), world_);
      out = torch::empty(shape, t.options());
    }
    const auto* data = static_cast<const uint8_t*>(t.data_ptr());
    auto* dst = rank_ == 0 ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
    py::gil_scoped_release nogil;
    for (int64_t lo = 0; lo < bytes || (bytes == 0 && lo == 0); lo += slot_) {
      const int64_t m = std::min(slot_, bytes - lo);
      const int64_t s = seq_ + 1;
      std::memcpy(slot(s, rank_), data + lo, m);
      publish_and_wait(s);
      if (rank_ == 0)
        for (int64_t r = 0; r < world_; ++r) std::memcpy(dst + r * bytes + lo, slot(s, r), m);
      seq_ = s;
      if (bytes == 0) break;
    }
    return rank_ == 0 ? out : torch::empty({0}, t.options());
  }

  // Seconds spent waiting for the other ranks since the start.
  double wait_seconds() const { return wait_seconds_; }

 private:
  std::atomic<int64_t>* flag(int64_t r) const { return reinterpret_cast<std::atomic<int64_t>*>(base_ + 64 * r); }
  uint8_t* slot(int64_t s, int64_t r) const { return base_ + 64 * world_ + ((s & 1) * world_ + r) * slot_; }

  void publish_and_wait(int64_t s) {
    flag(rank_)->store(s, std::memory_order_release);
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto checked = start;
    for (int64_t r = 0; r < world_; ++r) {
      int64_t spins = 0;
      while (flag(r)->load(std::memory_order_acquire) < s) {
        if (++spins < 4096) {
          _mm_pause();
          continue;
        }
        const auto now = clock::now();
        const double waited = std::chrono::duration<double>(now - start).count();
        if (waited > 0.002)  // sleep: 50 us steps for the first 0.1 s, then 1 ms
          std::this_thread::sleep_for(std::chrono::microseconds(waited < 0.1 ? 50 : 1000));
        if (now - checked > std::chrono::milliseconds(100)) {
          checked = now;
          check_peers();
        }
        spins = 0;
      }
    }
    wait_seconds_ += std::chrono::duration<double>(clock::now() - start).count();
  }

  void check_peers() const {
    for (int64_t r = 0; r < static_cast<int64_t>(pids_.size()); ++r)
      if (r != rank_ && !alive(pids_[r]))
        throw std::runtime_error("tensor-parallel rank " + std::to_string(r) + " (pid " + std::to_string(pids_[r]) +
                                 ") has exited");
  }

  // Whether process pid runs: it exists and is not a zombie (a child its parent has not reaped yet).
  static bool alive(int64_t pid) {
    if (kill(static_cast<pid_t>(pid), 0) != 0) return errno != ESRCH;
    std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
    if (f == nullptr) return true;
    char buf[512];
    const size_t got = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[got] = 0;
    const char* paren = std::strrchr(buf, ')');
    return paren == nullptr || paren[1] == 0 || paren[2] != 'Z';
  }

  torch::Tensor segment_;
  uint8_t* base_;
  int64_t rank_, world_, slot_;
  std::vector<int64_t> pids_;
  int64_t seq_ = 0;
  double wait_seconds_ = 0;
};

}  // namespace minerva

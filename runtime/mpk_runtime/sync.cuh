// Memory ordering, back-off, and the rings the runtime hands JIT tasks over with.
#pragma once
#include <cuda/atomic>

#include "mpk_tasks/common.cuh"  // globaltimer_ns
#include "types.cuh"

namespace mpk {

using dev_atomic_u64 = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;
using dev_atomic_u32 = cuda::atomic_ref<unsigned, cuda::thread_scope_device>;

__device__ __forceinline__ unsigned long long load_acquire(unsigned long long* p) {
  return dev_atomic_u64(*p).load(cuda::memory_order_acquire);
}

// Ring polls use relaxed loads issued together with a worker's other poll, and the poll that
// succeeds is followed by one acquire fence; a lone poll (an AOT head's counter) is an acquire
// load, which is cheaper than a relaxed load + fence.
__device__ __forceinline__ unsigned long long load_relaxed(unsigned long long* p) {
  return dev_atomic_u64(*p).load(cuda::memory_order_relaxed);
}

__device__ __forceinline__ void fence_acquire() {
  cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
}

__device__ __forceinline__ void store_release(unsigned long long* p, unsigned long long v) {
  dev_atomic_u64(*p).store(v, cuda::memory_order_release);
}

// A release add nobody needs the result of: a reduction, so no reply is awaited.
__device__ __forceinline__ void red_release(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long add_release(unsigned long long* p, unsigned long long v) {
  return dev_atomic_u64(*p).fetch_add(v, cuda::memory_order_acq_rel);
}

__device__ __forceinline__ int sm_id() {
  int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Spin bookkeeping for one wait: exponential __nanosleep back-off; every 1024 polls the waiter
// publishes what it waits on (host-mapped, for the watchdog) and checks the abort flag. Debug
// builds (MPK_DEBUG) trap after MPK_MAX_SPINS polls (mpk_tasks/common.cuh) so a hang becomes an error.

struct Spin {
  long long polls = 0;

  // Returns true when the wait must be abandoned (abort requested). Polls spin freely (a hop's
  // latency is what the runtime is for, and the persistent kernel owns the GPU); after ~16K
  // polls, long idle stretches sleep briefly between polls.
  __device__ __forceinline__ bool pause(const RuntimeArgs& a, volatile int* status) {
    ++polls;
    if (polls > (1 << 14)) __nanosleep(64);
    if ((polls & 1023) == 0) {
      if (status) status[kStSpins] = static_cast<int>(polls >> 10);
      // the watchdog stopped this launch or a later one (which stops an earlier one still
      // running too); a launch queued after the stopped one runs: the flag is never reset, so
      // no reset can race with a launch still queued
      if (*a.abort_flag >= a.epoch) return true;
#ifdef MPK_DEBUG
      if (polls > MPK_MAX_SPINS) {
        if (status) status[kStState] = kStateAborted;
        __trap();
      }
#endif
    }
    return false;
  }
  __device__ __forceinline__ void reset() { polls = 0; }
};

// Hop clocks (builds with -DMPK_HOP_CLOCKS only; benchmarks/hop_breakdown.py --clocks): thread
// 0 of each worker stamps its SM's cycle counter where a gated task's hop passes, sums three
// stretches in shared memory and writes them out when it leaves, so nothing is stored to
// global memory meanwhile (a release fence would wait for such a store). The stretches: kHopSeen
// → kHopStart (the waiter's wake-up: gate opened, block barrier, into the task), kHopStart →
// kHopEnd (task body and the closing barrier), kHopEnd → kHopRelease (the finisher's way to its
// release store). What a hop has beyond them is the store's way to the waiter's poll.
enum HopMark : int { kHopSeen, kHopStart, kHopEnd, kHopRelease, kHopMarks };
constexpr int kHopWorkers = 256, kHopFields = 8;  // per worker: 3 sums, count, cycles, ns, 2 spare
#ifdef MPK_HOP_CLOCKS
extern "C" {
__device__ long long mpk_hop_cycles[kHopWorkers][kHopFields];
}
struct HopClocks {
  long long at[kHopMarks];
  long long sum[kHopFields];
};
__device__ __forceinline__ HopClocks& hop_clocks() {
  __shared__ HopClocks s_hop;
  return s_hop;
}
__device__ __forceinline__ void hop_mark(HopMark m) {
  if (threadIdx.x != 0) return;
  HopClocks& h = hop_clocks();
  const long long now = clock64();
  const HopMark from = m == kHopStart ? kHopSeen : m == kHopEnd ? kHopStart : m == kHopRelease ? kHopEnd : kHopMarks;
  if (from != kHopMarks && h.at[from] > 0) {
    h.sum[from] += now - h.at[from];
    if (m == kHopEnd) ++h.sum[3];
    h.at[from] = 0;  // each stretch once per hop
  }
  h.at[m] = now;
}
__device__ __forceinline__ void hop_clocks_begin() {
  if (threadIdx.x != 0) return;
  hop_clocks() = HopClocks{};
  hop_clocks().sum[4] = clock64();
  hop_clocks().sum[5] = static_cast<long long>(globaltimer_ns());
}
__device__ __forceinline__ void hop_clocks_end(int w) {
  if (threadIdx.x != 0 || w >= kHopWorkers) return;
  HopClocks& h = hop_clocks();
  h.sum[4] = clock64() - h.sum[4];
  h.sum[5] = static_cast<long long>(globaltimer_ns()) - h.sum[5];
  for (int f = 0; f < kHopFields; ++f) mpk_hop_cycles[w][f] = h.sum[f];
}
#else
__device__ __forceinline__ void hop_mark(HopMark) {}
__device__ __forceinline__ void hop_clocks_begin() {}
__device__ __forceinline__ void hop_clocks_end(int) {}
#endif

// Single-producer single-consumer ring: the producer writes the slot and release-stores its
// sequence number (position + 1); the consumer polls the sequence (relaxed, issued with its
// other polls), fences, reads the value and publishes its head (read by debug checks). The host
// sizes every ring to hold all pushes of one iteration, and an iteration's pushes are consumed
// before the next one's start, so a ring never overflows; debug builds check it.
template <typename V>
struct Ring {
  V* values;
  unsigned long long* seq;
  unsigned long long* head;
  int capacity;

  __device__ __forceinline__ static Ring at(V* values, unsigned long long* seq, unsigned long long* head,
                                            int capacity, int q) {
    return Ring{values + static_cast<long long>(q) * capacity, seq + static_cast<long long>(q) * capacity,
                head + 16LL * q, capacity};
  }

  __device__ __forceinline__ void push(unsigned long long pos, const V& v) {
#ifdef MPK_DEBUG
    if (pos - load_acquire(head) >= static_cast<unsigned long long>(capacity)) __trap();
#endif
    const int slot = static_cast<int>(pos & (capacity - 1));
    values[slot] = v;
    store_release(seq + slot, pos + 1);
  }

  __device__ __forceinline__ unsigned long long peek(unsigned long long h) const {
    return load_relaxed(seq + (h & (capacity - 1)));
  }
  __device__ __forceinline__ bool try_pop(unsigned long long& h, V& v, unsigned long long peeked) {
    if (peeked != h + 1) return false;
    fence_acquire();
    v = values[h & (capacity - 1)];
    ++h;
    dev_atomic_u64(*head).store(h, cuda::memory_order_relaxed);
    return true;
  }
};

}  // namespace mpk

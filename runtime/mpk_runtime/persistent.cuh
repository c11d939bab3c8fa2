// The persistent kernel: one cooperative launch, one CTA per SM. CTAs [0, num_workers) are
// workers; the rest host scheduler warps (kSchedWarpsPerCta each). Include this after the
// generated code has defined ``mpk_execute_task(op, tile, buffers)``.
//
// Worker (thread 0 decides, the CTA executes): JIT queue first; else the head of its AOT list
// once that task's dependent event reached iteration·num_triggers; else back off. After a task
// the CTA synchronises and thread 0 release-adds 1 to the task's trigger event; the add that
// completes a multiple of num_triggers fires the event: its JIT tasks go to a scheduler, the
// end event starts the next iteration (start counter += 1) or, after the last, sets ``done``.
//
// Scheduler warp: pops fired events from its queue and hands the event's JIT tasks,
// round-robin over all workers, to the workers' JIT queues (lanes push in parallel).
#pragma once
#include "sync.cuh"
#include "types.cuh"

namespace mpk {

constexpr int kThreads = 256;
constexpr int kSchedWarpsPerCta = 4;
constexpr int kExit = -2;

__device__ __forceinline__ void notify_event(const RuntimeArgs& a, int e) {
  if (a.events[e].flags & kEventHasJit) {
    QueueRef::at(a.sched_values, a.sched_seq, a.sched_reserve, a.sched_head, a.sched_capacity, e % a.num_schedulers)
        .push(e, a);
  }
}

__device__ __forceinline__ void complete_task(const RuntimeArgs& a, int task) {
  const int e = a.tasks[task].trig_event;
  const unsigned long long n = static_cast<unsigned long long>(a.events[e].num_triggers);
  const unsigned long long now = add_release(a.counters + e, 1) + 1;
  if (now % n != 0) return;
  if (e != a.end_event) {
    notify_event(a, e);
    return;
  }
  if (now / n < static_cast<unsigned long long>(a.iterations)) {
    add_release(a.counters + a.start_event, 1);
    notify_event(a, a.start_event);
  } else {
    dev_atomic_u32(*a.done).store(1u, cuda::memory_order_release);
  }
}

// Thread 0 of a worker: the next task to run, or kExit.
__device__ int next_task(const RuntimeArgs& a, int w, long long& aot_pos, unsigned long long& jit_head) {
  const int aot_begin = a.aot_offsets[w];
  const long long n_aot = a.aot_offsets[w + 1] - aot_begin;
  const long long aot_total = n_aot * a.iterations;
  QueueRef jit = QueueRef::at(a.jit_values, a.jit_seq, a.jit_reserve, a.jit_head, a.jit_capacity, w);
  volatile int* status = a.status + static_cast<long long>(w) * kStatusWords;
  Spin spin;
  while (true) {
    int task;
    if (jit.try_pop(jit_head, task)) return task;
    if (aot_pos < aot_total) {
      task = a.aot_tasks[aot_begin + aot_pos % n_aot];
      const int e = a.tasks[task].dep_event;
      const unsigned long long need =
          static_cast<unsigned long long>(aot_pos / n_aot + 1) * static_cast<unsigned long long>(a.events[e].num_triggers);
      const unsigned long long have = load_acquire(a.counters + e);
      if (have >= need) {
        ++aot_pos;
        return task;
      }
      if ((spin.polls & 1023) == 1023) {
        status[kStState] = kStateWaitingAot;
        status[kStTask] = task;
        status[kStEvent] = e;
        status[kStCountLo] = static_cast<int>(have);
        status[kStNeedLo] = static_cast<int>(need);
        status[kStAotPos] = static_cast<int>(aot_pos);
        status[kStJitHead] = static_cast<int>(jit_head);
      }
    } else {
      if (dev_atomic_u32(*a.done).load(cuda::memory_order_acquire)) return kExit;
      if ((spin.polls & 1023) == 1023) {
        status[kStState] = kStateIdle;
        status[kStAotPos] = static_cast<int>(aot_pos);
        status[kStJitHead] = static_cast<int>(jit_head);
      }
    }
    if (spin.pause(a, status)) {
      status[kStState] = kStateAborted;
      return kExit;
    }
  }
}

__device__ void worker_loop(const RuntimeArgs& a, int w) {
  __shared__ int s_task;
  long long aot_pos = 0;
  unsigned long long jit_head = 0;
  unsigned n_profiled = 0;
  unsigned long long t0 = 0;
  while (true) {
    if (threadIdx.x == 0) {
      s_task = next_task(a, w, aot_pos, jit_head);
      if (a.profile) t0 = globaltimer_ns();
    }
    __syncthreads();
    const int task = s_task;
    if (task == kExit) break;
    const int op = a.tasks[task].op;
    if (op >= 0) mpk_execute_task(op, a.tasks[task].tile, a.buffers);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (a.profile && n_profiled < static_cast<unsigned>(a.profile_capacity)) {
        a.profile[static_cast<long long>(w) * a.profile_capacity + n_profiled++] =
            ProfileRecord{task, sm_id(), t0, globaltimer_ns()};
      }
      complete_task(a, task);
    }
  }
  if (threadIdx.x == 0) {
    volatile int* status = a.status + static_cast<long long>(w) * kStatusWords;
    if (status[kStState] != kStateAborted) status[kStState] = kStateExited;
    status[kStAotPos] = static_cast<int>(aot_pos);
    if (a.profile) a.profile_count[w] = n_profiled;
  }
}

__device__ void scheduler_loop(const RuntimeArgs& a, int s) {
  const int lane = threadIdx.x & 31;
  QueueRef q = QueueRef::at(a.sched_values, a.sched_seq, a.sched_reserve, a.sched_head, a.sched_capacity, s);
  volatile int* status = a.status + static_cast<long long>(a.num_workers + s) * kStatusWords;
  unsigned long long head = 0;
  Spin spin;
  while (true) {
    int e = -1;
    if (lane == 0) {
      if (!q.try_pop(head, e)) {
        if (dev_atomic_u32(*a.done).load(cuda::memory_order_acquire)) e = kExit;
        else if (spin.pause(a, status)) e = kExit;
        if (e == kExit) status[kStState] = kStateExited;
      } else {
        spin.reset();
      }
    }
    e = __shfl_sync(0xffffffffu, e, 0);
    if (e == kExit) return;
    if (e < 0) continue;
    const EventDesc ev = a.events[e];
    for (int t = ev.first_task + lane; t < ev.last_task; t += 32) {
      if (a.tasks[t].flags & kTaskJit) {
        const int w = static_cast<int>(dev_atomic_u64(*a.next_worker).fetch_add(1, cuda::memory_order_relaxed) %
                                       static_cast<unsigned long long>(a.num_workers));
        QueueRef::at(a.jit_values, a.jit_seq, a.jit_reserve, a.jit_head, a.jit_capacity, w).push(t, a);
      }
    }
  }
}

}  // namespace mpk

extern "C" __global__ void __launch_bounds__(mpk::kThreads, 1) mpk_persistent_kernel(const mpk::RuntimeArgs* args) {
  const mpk::RuntimeArgs& a = *args;
  if (static_cast<int>(blockIdx.x) < a.num_workers) {
    mpk::worker_loop(a, blockIdx.x);
    return;
  }
  const int warp = threadIdx.x >> 5;
  const int s = (blockIdx.x - a.num_workers) * mpk::kSchedWarpsPerCta + warp;
  if (warp < mpk::kSchedWarpsPerCta && s < a.num_schedulers) {
    if (blockIdx.x == a.num_workers && warp == 0 && (threadIdx.x & 31) == 0) {
      mpk::notify_event(a, a.start_event);  // iteration 1's start event: host set its counter to 1
    }
    __syncwarp();
    mpk::scheduler_loop(a, s);
  }
}

// Test wrapper: every tile of one op, one CTA per tile, no scheduling (task families alone).
extern "C" __global__ void __launch_bounds__(mpk::kThreads) mpk_tile_kernel(void* const* buffers, int op) {
  mpk_execute_task(op, blockIdx.x, buffers);
}

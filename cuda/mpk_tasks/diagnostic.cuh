// Task family: diagnostics for runtime tests and benchmarks. ``stamp``: thread 0 takes a
// start position from a device-wide clock, spins busy_ns, takes an end position, and logs
// both for (its run number, its tile). inputs: clock [1], runs [N], log [I, N, 2] (int64).
#pragma once
#include "common.cuh"

namespace mpk {

// iparam[0]: maximum busy time in ns (0: empty tasks); each task spins a pseudo-random share
// of it, fixed per tile, so fan-in waits on producers of different lengths.
// iparam[1]: 0 for an empty task that returns at once (runtime-overhead benchmarks).
__device__ void task_stamp(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (threadIdx.x != 0 || c.iparam[1] == 0) return;
  auto* clock = static_cast<unsigned long long*>(env.buffers[c.in[0].buffer]);
  auto* runs = static_cast<unsigned long long*>(env.buffers[c.in[1].buffer]);
  auto* log = static_cast<long long*>(env.buffers[c.in[2].buffer]);
  const long long n = c.out_shape[0], iters = c.in[2].shape[0];
  for (long long t = r.lo[0]; t < r.hi[0]; ++t) {
    const unsigned long long run = atomicAdd(runs + t, 1ULL);
    const long long start = static_cast<long long>(atomicAdd(clock, 1ULL));
    const long long busy = c.iparam[0] > 0 ? static_cast<long long>((t * 2654435761ULL) % (c.iparam[0] + 1)) : 0;
    if (busy > 0) {
      const unsigned long long t0 = globaltimer_ns();
      bool stopped = false;
      for (long long polls = 1; globaltimer_ns() - t0 < static_cast<unsigned long long>(busy); ++polls) {
        // a busy time past the watchdog's limit is a hang on purpose (runtime tests): its back-off
        // names the task and leaves when the launch is stopped
        if (polls % kTaskWaitCheck == 0 && task_wait_backoff(kWaitBusy, polls)) {
          stopped = true;
          break;
        }
      }
      if (stopped) return;
    }
    const long long end = static_cast<long long>(atomicAdd(clock, 1ULL));
    if (run < static_cast<unsigned long long>(iters)) {
      log[(run * n + t) * 2] = start;
      log[(run * n + t) * 2 + 1] = end;
    }
    static_cast<long long*>(env.buffers[c.out_buffer])[t] = static_cast<long long>(run + 1);
  }
}

}  // namespace mpk

// Task family: the balanced split-KV plan of the ragged form's attention (attn_plan;
// mpk.ops.paged: attention_plan and block_costs are its Python form and say what it holds).
// Made inside the launch from the run-time page table, once per step (every layer's attention
// reads the same table), by one task that runs beside the first layer's projections.
#pragma once
#include "paged_attention.cuh"

namespace mpk {

// Sum of v over the task's threads, returned to all (scratch: 8 long longs).
__device__ __forceinline__ long long task_sum(long long v, long long* scratch8) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // scratch8's last readers are done
  if ((threadIdx.x & 31) == 0) scratch8[threadIdx.x >> 5] = v;
  __syncthreads();
  long long all = 0;
#pragma unroll
  for (int w = 0; w < kThreadsPerTask / 32; ++w) all += scratch8[w];
  return all;
}

// The sum of v over the threads before this one (thread order), and the total in `all`.
__device__ __forceinline__ long long task_exclusive_scan(long long v, long long& all, long long* scratch8) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long up = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += up;
  }
  __syncthreads();
  if (lane == 31) scratch8[warp] = inc;
  __syncthreads();
  long long before = inc - v;
  all = 0;
#pragma unroll
  for (int w = 0; w < kThreadsPerTask / 32; ++w) {
    if (w < warp) before += scratch8[w];
    all += scratch8[w];
  }
  return before;
}

// attn_plan — inputs kv_indptr [B+1], kv_last_page_len [B], qo_indptr [B+1] (of I); iparam:
// token rows T, rows R a block, items C a block, target P, page_size; output int plan
// [W + NB + 1] (NB = ⌈T / R⌉, W = NB·C): item_block[W], then block_start[NB + 1]. Each thread
// takes a contiguous range of blocks: their costs (kept in block_start meanwhile), the task's
// sum and non-empty count give L, then the range's item counts, their exclusive scan over the
// threads, the starts and the items. Faults of the table are the attention tasks' to report: a
// qo_indptr at fault gives a plan of no items, a sequence whose span is at fault costs nothing.
template <typename I>
__device__ __forceinline__ void attn_plan(const OpC& c, const Rect&, const TaskEnv& env) {
  const ViewC &indptr = c.in[0], &last = c.in[1], &qo = c.in[2];
  const long long T = c.iparam[0], R = c.iparam[1], C = c.iparam[2], P = c.iparam[3];
  const int page_size = static_cast<int>(c.iparam[4]);
  const long long NB = (T + R - 1) / R, W = NB * C;
  int* const plan = static_cast<int*>(env.buffers[c.out_buffer]);
  int* const start = plan + W;
  const I* ip = static_cast<const I*>(env.buffers[indptr.buffer]) + indptr.offset;
  const I* lp = static_cast<const I*>(env.buffers[last.buffer]) + last.offset;
  const I* qp = static_cast<const I*>(env.buffers[qo.buffer]) + qo.offset;
  const long long B = qo.shape[0] - 1, qs = qo.stride[0], is = indptr.stride[0], ls = last.stride[0];
  long long* const red = reinterpret_cast<long long*>(scratch());
  bool bad = false;
  for (long long i = threadIdx.x; i <= B; i += kThreadsPerTask)
    bad |= qo_entry_fault(i, qp[i * qs], i ? static_cast<long long>(qp[(i - 1) * qs]) : 0, T);
  const long long used = __syncthreads_or(bad) ? 0 : static_cast<long long>(qp[B * qs]);
  const auto length = [&](long long b) -> long long {
    const long long p0 = ip[b * is], p1 = ip[(b + 1) * is], tail = lp[b * ls];
    if (p0 < 0 || p1 < p0 || (p1 > p0 && (tail < 1 || tail > page_size))) return 0;
    return p1 == p0 ? 0 : (p1 - p0 - 1) * page_size + tail;
  };
  const long long per = (NB + kThreadsPerTask - 1) / kThreadsPerTask;
  const long long b0 = min(NB, threadIdx.x * per), b1 = min(NB, b0 + per);
  long long total = 0, live = 0;
  for (long long i = b0; i < b1; ++i) {
    long long cost = 0;
    const long long end = min(i * R + R, used);
    for (long long t = i * R, b = t < end ? qo_sequence(qp, qs, B, t) : 0; t < end; ++b) {
      const long long r0 = qp[b * qs], r1 = qp[(b + 1) * qs];
      if (r1 <= t) continue;  // a sequence without rows here
      const long long seg_end = min(end, r1), n = length(b);
      if (r1 - r0 <= n) cost += n - (r1 - seg_end);  // the segment's last row's position + 1
      t = seg_end;
    }
    start[i] = static_cast<int>(cost);
    total += cost;
    live += cost > 0;
  }
  total = task_sum(total, red);
  live = task_sum(live, red + 8);
  const long long parts = max(1LL, min(P, W - live));
  const long long L = max(kMinChunk, (total + parts - 1) / parts);
  long long mine = 0;
  for (long long i = b0; i < b1; ++i) mine += (start[i] + L - 1) / L;
  long long all = 0;
  long long w = task_exclusive_scan(mine, all, red + 16);
  for (long long i = b0; i < b1; ++i) {
    const long long k = (start[i] + L - 1) / L;
    start[i] = static_cast<int>(w);
    for (long long j = 0; j < k; ++j) plan[w + j] = static_cast<int>(i);
    w += k;
  }
  if (threadIdx.x == 0) start[NB] = static_cast<int>(all);
  for (long long x = all + threadIdx.x; x < W; x += kThreadsPerTask) plan[x] = -1;
}

}  // namespace mpk

// Task family: the start-of-iteration task (mpk/ops/iteration.py documents the state layout,
// the semantics and why one task after the sampler orders every reader of what it rewrites).
// One CTA, a thread per sequence row (B ≤ kThreadsPerTask); the CPU tile is the reference.
#pragma once
#include "common.cuh"

namespace mpk {

// Block-wide exclusive prefix sum of one int per thread (every thread calls it); total: the
// sum over the block. warp_sums: kThreadsPerTask / 32 ints of shared memory.
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kThreadsPerTask / 32; ++w) {
    const int s = warp_sums[w];
    before += w < warp ? s : 0;
    all += s;
  }
  __syncthreads();  // warp_sums free for the next call
  total = all;
  return before + x - v;
}

// inputs: next [B] i64, tokens [B] i64, kv_indptr [B + 1] i32, kv_indices [N] i32,
// kv_last_page_len [B] i32, seqs [B, 4 + S + P] i32, pool [2 + F] i32, out [K, B] i32 (whole,
// contiguous: the op's check); output emitted [B] i64. iparam: page_size, max_len, S.
__device__ void task_decode_advance(const OpC& c, const Rect&, const TaskEnv& env) {
  constexpr int kLen = 0, kGen = 1, kMax = 2, kDone = 3, kSeqFields = 4, kStep = 0, kTop = 1, kPoolFields = 2;
  const int b = threadIdx.x;
  const int B = static_cast<int>(c.out_shape[0]);
  const int page_size = static_cast<int>(c.iparam[0]), max_len = static_cast<int>(c.iparam[1]);
  const int S = static_cast<int>(c.iparam[2]);
  const long long* next = static_cast<const long long*>(env.buffers[c.in[0].buffer]);
  long long* tokens = static_cast<long long*>(env.buffers[c.in[1].buffer]);
  int* indptr = static_cast<int*>(env.buffers[c.in[2].buffer]);
  int* indices = static_cast<int*>(env.buffers[c.in[3].buffer]);
  int* last = static_cast<int*>(env.buffers[c.in[4].buffer]);
  int* seqs = static_cast<int*>(env.buffers[c.in[5].buffer]);
  int* pool = static_cast<int*>(env.buffers[c.in[6].buffer]);
  int* out = static_cast<int*>(env.buffers[c.in[7].buffer]);
  long long* emitted = static_cast<long long*>(env.buffers[c.out_buffer]);
  const long long width = c.in[5].shape[1], N = c.in[3].shape[0], K = c.in[7].shape[0];
  int* warp_sums = reinterpret_cast<int*>(scratch());

  // every thread reads the pool's counters before thread 0 rewrites them (after the scans' syncs)
  const int step = pool[kStep], top = pool[kTop];
  int* row = seqs + b * width;
  int* table = row + kSeqFields + S;
  const bool in_batch = b < B;
  const bool live = in_batch && row[kDone] == 0;
  long long t = -1;
  int n = 0, gen = 0;
  bool stop = false, need = false;
  if (live) {
    t = next[b];
    gen = row[kGen] + 1;
    n = row[kLen] + 1;  // the sequence's tokens with t; t sits at position n − 1
    for (int j = 0; j < S; ++j) stop |= row[kSeqFields + j] == t;
    stop = stop || gen >= row[kMax] || n >= max_len;
    need = !stop && (n - 1) % page_size == 0;  // t starts a page
  }
  // the rows needing a page take them from the top of the free list in row order
  int needed;
  const int rank = block_exclusive_sum(need ? 1 : 0, warp_sums, needed);
  if (need) {
    if (rank < top) {
      table[(n - 1) / page_size] = pool[kPoolFields + top - 1 - rank];
    } else {
      stop = true;  // the free list ran dry: this row's run ends here (no finish: the host resumes it)
    }
  }
  if (live) {
    row[kGen] = gen;
    if (stop) {
      row[kDone] = 1;
    } else {
      row[kLen] = n;
      tokens[b] = t;
    }
  }
  if (in_batch) {
    emitted[b] = t;
    out[(step % K) * B + b] = static_cast<int>(t);
  }
  if (b == 0) {
    pool[kStep] = step + 1;
    pool[kTop] = needed < top ? top - needed : 0;
  }
  // the page table from every row's length and block table
  const int len = in_batch ? row[kLen] : 0;
  const int count = (len + page_size - 1) / page_size;
  int total;
  const long long start = block_exclusive_sum(count, warp_sums, total);
  if (in_batch) {
    for (int j = 0; j < count && start + j < N; ++j) indices[start + j] = table[j];
    indptr[b + 1] = static_cast<int>(start + count < N ? start + count : N);
    last[b] = len > 0 ? (len - 1) % page_size + 1 : 0;
  }
  if (b == 0) indptr[0] = 0;
  __syncthreads();  // (the scratch was used)
}

}  // namespace mpk

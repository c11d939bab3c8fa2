// Task family: collectives between tensor-parallel ranks (mpk.ops.collective: the protocol,
// why two receive slots suffice, why the ranks cannot deadlock). ``comm_put`` copies a tile
// into every peer's receive slot and signals it; ``comm_reduce`` (all_reduce) and
// ``comm_gather`` (all_gather) wait for the peers' signals of their tile and combine.
//
// Peers are reached by plain stores and loads through the addresses in the graph's peer tables
// (NVSHMEM's nvshmem_ptr: NVLink P2P mappings), so the kernel needs no NVSHMEM device library.
//
// Memory ordering (PTX memory model, system scope, since the peer is another GPU):
//  * put: every thread stores its part of the tile into the peer's slot; bar.sync orders those
//    stores before thread 0's next operations (CTA scope, and release cumulativity carries
//    them on); thread 0 then issues fence.acq_rel.sys and st.release.sys of the sequence
//    number into the peer's signal. A peer that observes the signal therefore observes the
//    tile's data.
//  * wait: thread 0 polls the signal with ld.acquire.sys until it reaches the sequence number
//    expected, then bar.sync hands that acquire to the CTA; the slot is read with ld.global.cg
//    (L2, not L1: an L1 line could still hold what the slot had two iterations ago; the
//    ld.nc path must never see it either, since the data changes within the launch).
//  * the sequence counters (seq) are rank-local and written by thread 0 after a bar.sync that
//    follows every use of the old value; the task's CTA-wide completion then orders them before
//    the next iteration, like any output.
//  * a wait honours the runtime's abort flag (task_wait_backoff every kTaskWaitCheck polls: a
//    dead peer becomes a watchdog report naming this task, not a hang); debug builds trap after
//    MPK_MAX_SPINS polls.
#pragma once
#include "common.cuh"

namespace mpk {

constexpr int kMaxRanks = 64;  // mpk.ops.collective.MAX_RANKS: the reduce keeps a count per rank in shared memory

// iparam (mpk.ops.collective._params): rank, world, tiles rows tm, tiles cols tn, data rows M, cols N.
struct CommShape {
  long long rank, world, tm, tn, M, N;
  __device__ __forceinline__ explicit CommShape(const OpC& c)
      : rank(c.iparam[0]), world(c.iparam[1]), tm(c.iparam[2]), tn(c.iparam[3]), M(c.iparam[4]), N(c.iparam[5]) {}
  __device__ __forceinline__ long long tiles() const { return tm * tn; }
  // element (slot, rank p, row, col) of a contiguous receive buffer [2, world, M, N]
  __device__ __forceinline__ long long slot_index(long long slot, long long p, long long row, long long col) const {
    return ((slot * world + p) * M + row) * N + col;
  }
};

// mpk.ops.collective.tile_index: the tile of the balanced split of `extent` into `parts` starting at `start`.
__device__ __forceinline__ long long comm_tile_of(long long extent, long long parts, long long start) {
  return (start * parts + extent - 1) / extent;
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("fence.acq_rel.sys;\n\tst.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 waits until signal[p, t] ≥ need[p] for the ranks p in [p0, p1) other than ours;
// block-wide answer: false if the launch was stopped (the caller returns at once).
__device__ __forceinline__ bool comm_wait(const CommShape& s, const unsigned long long* signals, long long t,
                                         const long long* need, long long p0, long long p1) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    for (long long p = p0; p < p1 && ok; ++p) {
      if (p == s.rank) continue;
      for (long long polls = 1; ld_acquire_sys(signals + p * s.tiles() + t) < static_cast<unsigned long long>(need[p - p0]);
           ++polls) {
        if (polls % kTaskWaitCheck == 0) {
          if (task_wait_backoff(kWaitSignal, polls)) {
            ok = 0;
            break;
          }
#ifdef MPK_DEBUG
          if (polls > MPK_MAX_SPINS) __trap();
#endif
        }
      }
    }
  }
  __syncthreads();
  return ok != 0;
}

// comm_put — inputs src [M, N] (T), peers of recv [world], peers of signals [world] (int64),
// seq [1 + world, tiles] (int64); tile (i, j) of the [tm, tn] token output.
template <typename T>
__device__ void comm_put(const OpC& c, const Rect& r, const TaskEnv& env) {
  const CommShape s(c);
  const ViewC &src = c.in[0], &pr = c.in[1], &ps = c.in[2], &sq = c.in[3];
  const long long i = r.lo[0], j = r.lo[1], t = i * s.tn + j;
  const long long r0 = i * s.M / s.tm, r1 = (i + 1) * s.M / s.tm, c0 = j * s.N / s.tn, c1 = (j + 1) * s.N / s.tn;
  auto* seq = static_cast<long long*>(env.buffers[sq.buffer]) + sq.offset;
  const long long n = seq[t] + 1;  // seq[0, t]
  const auto* peers_recv = static_cast<const long long*>(env.buffers[pr.buffer]) + pr.offset;
  const auto* peers_sig = static_cast<const long long*>(env.buffers[ps.buffer]) + ps.offset;
  const T* x = static_cast<const T*>(env.buffers[src.buffer]) + src.offset;
  const long long w = c1 - c0, count = (r1 - r0) * w;
  // 16-byte stores where rows are contiguous and aligned on both sides (the tile's columns
  // rounded inwards to whole vectors, its edge columns element-wise): a peer store crosses
  // NVLink as its own transaction, so an element-wise copy pays one per 2 or 4 bytes
  constexpr long long V = 16 / sizeof(T);
  const long long ca = (c0 + V - 1) / V * V, cb = c1 / V * V;
  const bool vec = src.stride[1] == 1 && s.N % V == 0 && src.stride[0] % V == 0 && ca < cb &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0;
  for (long long p = 0; p < s.world; ++p) {
    if (p == s.rank) continue;
    T* dst = reinterpret_cast<T*>(peers_recv[p]);
    if (vec && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
      const long long wv = (cb - ca) / V, we = (ca - c0) + (c1 - cb);
      for (long long e = threadIdx.x; e < (r1 - r0) * wv; e += blockDim.x) {
        const long long row = r0 + e / wv, col = ca + (e % wv) * V;
        *reinterpret_cast<uint4*>(dst + s.slot_index(n % 2, s.rank, row, col)) =
            *reinterpret_cast<const uint4*>(x + row * src.stride[0] + col);
      }
      for (long long e = threadIdx.x; e < (r1 - r0) * we; e += blockDim.x) {
        const long long row = r0 + e / we, k = e % we, col = k < ca - c0 ? c0 + k : cb + (k - (ca - c0));
        dst[s.slot_index(n % 2, s.rank, row, col)] = x[row * src.stride[0] + col];
      }
      continue;
    }
    for (long long e = threadIdx.x; e < count; e += blockDim.x) {
      const long long row = r0 + e / w, col = c0 + e % w;
      dst[s.slot_index(n % 2, s.rank, row, col)] = x[row * src.stride[0] + col * src.stride[1]];
    }
  }
  __syncthreads();  // the whole tile's stores, before thread 0's release
  if (threadIdx.x == 0) {
    for (long long p = 0; p < s.world; ++p)
      if (p != s.rank)
        st_release_sys(reinterpret_cast<unsigned long long*>(peers_sig[p]) + s.rank * s.tiles() + t,
                       static_cast<unsigned long long>(n));
    seq[t] = n;
    static_cast<long long*>(env.buffers[c.out_buffer])[t] = n;
  }
}

// Inputs of comm_reduce / comm_gather: local [M, N] (T), the put's tokens, recv [2, world, M, N]
// (T), signals [world, tiles], seq [1 + world, tiles] (int64), (reduce:) residual [M, N].
// Rank p's tile: its local input for our rank, else our receive slot n % 2, p.
template <typename T>
__device__ __forceinline__ float comm_load(const CommShape& s, const ViewC& local, const T* x, const T* recv,
                                           long long n, long long p, long long row, long long col) {
  if (p == s.rank) return to_f(x[row * local.stride[0] + col * local.stride[1]]);
  return to_f(__ldcg(recv + s.slot_index(n % 2, p, row, col)));
}

// all_reduce: out = residual + Σ_p rank p's tile, float32, in rank order p = 0 … world − 1 (every
// rank sums the same values in the same order: bit-identical results).
template <typename T>
__device__ void comm_reduce(const OpC& c, const Rect& r, const TaskEnv& env) {
  const CommShape s(c);
  const ViewC &local = c.in[0], &rv = c.in[2], &sg = c.in[3], &sq = c.in[4];
  const long long t = comm_tile_of(s.M, s.tm, r.lo[0]) * s.tn + comm_tile_of(s.N, s.tn, r.lo[1]);
  auto* seq = static_cast<long long*>(env.buffers[sq.buffer]) + sq.offset;
  __shared__ long long need[kMaxRanks];
  if (threadIdx.x < s.world) need[threadIdx.x] = seq[(1 + threadIdx.x) * s.tiles() + t] + 1;
  __syncthreads();
  const auto* signals = static_cast<const unsigned long long*>(env.buffers[sg.buffer]) + sg.offset;
  if (!comm_wait(s, signals, t, need, 0, s.world)) return;
  const T* x = static_cast<const T*>(env.buffers[local.buffer]) + local.offset;
  const T* recv = static_cast<const T*>(env.buffers[rv.buffer]) + rv.offset;
  const bool has_res = c.num_inputs > 5;
  const ViewC& res = c.in[has_res ? 5 : 0];
  const T* rx = static_cast<const T*>(env.buffers[res.buffer]) + res.offset;
  T* out = static_cast<T*>(env.buffers[c.out_buffer]);
  const long long w = r.hi[1] - r.lo[1], count = (r.hi[0] - r.lo[0]) * w;
  for (long long e = threadIdx.x; e < count; e += blockDim.x) {
    const long long row = r.lo[0] + e / w, col = r.lo[1] + e % w;
    float acc = 0.f;
    for (long long p = 0; p < s.world; ++p) acc += comm_load(s, local, x, recv, need[p], p, row, col);
    if (has_res) acc = to_f(rx[row * res.stride[0] + col * res.stride[1]]) + acc;
    out[row * s.N + col] = from_f<T>(acc);
  }
  __syncthreads();  // every read of the slots and of need[] is done
  if (threadIdx.x < s.world) seq[(1 + threadIdx.x) * s.tiles() + t] = need[threadIdx.x];
}

// all_gather: out [M, world, N], tile (rows, rank p, cols) = rank p's tile.
template <typename T>
__device__ void comm_gather(const OpC& c, const Rect& r, const TaskEnv& env) {
  const CommShape s(c);
  const ViewC &local = c.in[0], &rv = c.in[2], &sg = c.in[3], &sq = c.in[4];
  const long long p = r.lo[1];
  const long long t = comm_tile_of(s.M, s.tm, r.lo[0]) * s.tn + comm_tile_of(s.N, s.tn, r.lo[2]);
  auto* seq = static_cast<long long*>(env.buffers[sq.buffer]) + sq.offset;
  const long long need = seq[(1 + p) * s.tiles() + t] + 1;
  const auto* signals = static_cast<const unsigned long long*>(env.buffers[sg.buffer]) + sg.offset;
  if (!comm_wait(s, signals, t, &need, p, p + 1)) return;
  const T* x = static_cast<const T*>(env.buffers[local.buffer]) + local.offset;
  const T* recv = static_cast<const T*>(env.buffers[rv.buffer]) + rv.offset;
  T* out = static_cast<T*>(env.buffers[c.out_buffer]);
  const long long w = r.hi[2] - r.lo[2], count = (r.hi[0] - r.lo[0]) * w;
  for (long long e = threadIdx.x; e < count; e += blockDim.x) {
    const long long row = r.lo[0] + e / w, col = r.lo[2] + e % w;
    out[(row * s.world + p) * s.N + col] = from_f<T>(comm_load(s, local, x, recv, need, p, row, col));
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[(1 + p) * s.tiles() + t] = need;
}

}  // namespace mpk

// Micro-benchmark: how long an input gate's poll takes to come back while the worker's own
// weight preloads are in flight, and whether that depends on who polls and how the weights are
// loaded (H100/H200). Every SM runs one CTA that, each round, issues a 64 KiB weight group
// (16 16-byte loads per lane over 256 threads, as the decode linear does before its gate), polls
// a counter that is already set, and then consumes the weights; all SMs stream at once, as in a
// decode step. Printed per variant: from the round's start (the preloads issued first) to the
// poll's return, mean, 99th percentile and max in ns, and how long thread 0's part of the weight
// group took to land. A poll with nothing in flight anywhere is the floor.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a gate_poll.cu -o gate_poll
#include <cuda/atomic>

#include <algorithm>
#include <cstdio>
#include <vector>

using A = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;
constexpr int kRounds = 256, kLoads = 16, kWorkThreads = 256, kGroup = kWorkThreads * kLoads * 16;  // 64 KiB

// How the weights are preloaded and who polls.
enum Mode : int {
  kIdle,           // no weight loads anywhere: the poll's floor
  kLoadsAcquire,   // ld.global.nc into registers; thread 0 (which has its own loads out) acquire-polls
  kLoadsRelaxed,   // same, relaxed poll (then one acquire fence once it succeeded)
  kLoadsOtherWarp, // same loads; a ninth warp with no loads of its own acquire-polls
  kLoadsOtherWarpRelaxed,  // same, relaxed poll + fence
  kBulkSmem,       // cp.async.bulk (the copy engine) of the group into shared memory; thread 0 acquire-polls
  kCpAsyncSmem,    // cp.async 16-byte copies into shared memory; thread 0 acquire-polls
  kBulkRows,       // the linear's shape: 64 bulk copies of one 1 KiB row piece each (rows 16 KiB apart), by thread 0
  kBulkRowsWarps,  // the same 64 copies, 8 by each warp's lane 0; thread 0 acquire-polls
  kWarp0Spared,    // warps 1-7 register-load their parts and cp.async warp 0's part into shared memory
                   // (completion on an mbarrier); warp 0 has nothing in flight; thread 0 acquire-polls
  kModes
};
const char* kNames[kModes] = {"idle: no loads anywhere",
                              "register loads, thread 0 acquire-polls",
                              "register loads, thread 0 relaxed poll + fence",
                              "register loads, idle 9th warp acquire-polls",
                              "register loads, idle 9th warp relaxed + fence",
                              "bulk copy to smem, thread 0 acquire-polls",
                              "cp.async to smem, thread 0 acquire-polls",
                              "64 row copies by thread 0, it acquire-polls",
                              "64 row copies, 8 per warp, thread 0 polls",
                              "warps 1-7 load warp 0's part too, thread 0 polls"};

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <int M>
__global__ void __launch_bounds__(288, 1) rounds(const uint4* weights, long long groups, unsigned long long* flag,
                                                 unsigned long long* poll_cycles, unsigned long long* land_cycles,
                                                 unsigned* sink) {
  extern __shared__ __align__(128) uint4 smem[];  // kGroup bytes (+ row padding)
  __shared__ __align__(8) unsigned long long bar;
  const int tid = threadIdx.x;
  const bool poller = (M == kLoadsOtherWarp || M == kLoadsOtherWarpRelaxed) ? tid == kWorkThreads : tid == 0;
  const bool loader = tid < kWorkThreads && M != kIdle;
  const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  if (tid == 0) asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(bar_addr), "r"(M == kWarp0Spared ? kWorkThreads - 32 : 1));
  __syncthreads();
  unsigned acc = 0;
  for (int r = 0; r < kRounds; ++r) {
    const uint4* g = weights + ((static_cast<long long>(r) * gridDim.x + blockIdx.x) % groups) * (kGroup / 16);
    uint4 v[kLoads];
    const long long t_issue = clock64();  // the task's start: preloads issued, then the poll
    if (M == kWarp0Spared && tid >= 32 && tid < kWorkThreads) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) v[i] = ld_stream(g + i * kWorkThreads + tid);
      for (int e = tid - 32; e < 32 * kLoads; e += kWorkThreads - 32) {  // warp 0's loads: piece (i, lane)
        const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem + e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g + (e / 32) * kWorkThreads + e % 32) : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(bar_addr) : "memory");
    }
    if (loader && (M == kLoadsAcquire || M == kLoadsRelaxed || M == kLoadsOtherWarp || M == kLoadsOtherWarpRelaxed)) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) v[i] = ld_stream(g + i * kWorkThreads + tid);
    }
    if (M == kCpAsyncSmem && loader) {
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem + i * kWorkThreads + tid));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g + i * kWorkThreads + tid) : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    if (M == kBulkSmem && tid == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(kGroup) : "memory");
      for (int part = 0; part < 4; ++part)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         static_cast<unsigned>(__cvta_generic_to_shared(smem + part * (kGroup / 64)))),
                     "l"(g + part * (kGroup / 64)), "r"(kGroup / 4), "r"(bar_addr)
                     : "memory");
    }
    if ((M == kBulkRows && tid == 0) || (M == kBulkRowsWarps && tid % 32 == 0 && tid < kWorkThreads)) {
      // row i of the group: 1 KiB at row i of a [64, 8192] bf16 weight, into a 1088-byte pitch
      const int first = M == kBulkRows ? 0 : tid / 32 * 8, last = M == kBulkRows ? 64 : first + 8;
      if (tid == 0) asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(kGroup) : "memory");
      const uint4* base = weights + ((static_cast<long long>(r) * gridDim.x + blockIdx.x) % (groups / 16)) * 16 * (kGroup / 16);
      for (int i = first; i < last; ++i)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         static_cast<unsigned>(__cvta_generic_to_shared(smem)) + i * 1088),
                     "l"(base + i * 1024), "r"(1024), "r"(bar_addr)
                     : "memory");
    }
    if (poller) {
      unsigned long long have;
      if (M == kLoadsRelaxed || M == kLoadsOtherWarpRelaxed) {
        while ((have = A(*flag).load(cuda::memory_order_relaxed)) == 0) {}
        cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
      } else {
        while ((have = A(*flag).load(cuda::memory_order_acquire)) == 0) {}
      }
      const long long t_seen = clock64();
      acc += static_cast<unsigned>(have);
      poll_cycles[static_cast<long long>(blockIdx.x) * kRounds + r] = t_seen - t_issue;
    }
    __syncthreads();  // the gate opens for everyone
    // consume the group; thread 0 stamps when its own part has landed
    if (loader) {
      if (M == kCpAsyncSmem) asm volatile("cp.async.wait_all;" ::: "memory");
      if (M == kBulkSmem || M == kBulkRows || M == kBulkRowsWarps || (M == kWarp0Spared && tid < 32)) {
        unsigned done = 0;
        while (!done)
          asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                       : "=r"(done) : "r"(bar_addr), "r"(r & 1) : "memory");
      }
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const uint4 w = M == kWarp0Spared ? (tid < 32 ? smem[i * 32 + tid] : v[i])
                        : (M == kCpAsyncSmem || M == kBulkSmem || M == kBulkRows || M == kBulkRowsWarps)
                            ? smem[(i * kWorkThreads + tid) % (64 * 68)]
                            : v[i];
        acc ^= w.x + w.y * 3 + w.z * 5 + w.w * 7;
      }
      if (tid == 0) land_cycles[static_cast<long long>(blockIdx.x) * kRounds + r] = clock64() - t_issue;
    }
    __syncthreads();  // the smem group is free again
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev);
  const long long bytes = 2LL << 30;  // far beyond L2: every group comes from HBM
  uint4* weights;
  unsigned long long *flag, *poll, *land;
  unsigned* sink;
  cudaMalloc(&weights, bytes);
  cudaMemset(weights, 0x5a, bytes);
  cudaMalloc(&flag, 256);
  const unsigned long long one = 1;
  cudaMemcpy(flag, &one, 8, cudaMemcpyHostToDevice);
  const size_t n = static_cast<size_t>(sms) * kRounds;
  cudaMalloc(&poll, n * 8);
  cudaMalloc(&land, n * 8);
  cudaMalloc(&sink, sms * 4);
  std::vector<unsigned long long> hp(n), hl(n);
  const double ns_per_cycle = 1e6 / clock_khz;
  printf("%d SMs, %.0f MHz; per round each SM preloads 64 KiB, then polls a set counter\n", sms, clock_khz / 1e3);
  printf("%-48s %9s %9s %9s %10s\n", "variant", "poll ns", "poll p99", "poll max", "landed ns");
  auto run = [&](auto kernel, int mode) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1088);
    for (int rep = 0; rep < 2; ++rep) {
      cudaMemset(land, 0, n * 8);
      kernel<<<sms, 288, 64 * 1088>>>(weights, bytes / kGroup, flag, poll, land, sink);
      const cudaError_t err = cudaDeviceSynchronize();
      if (err != cudaSuccess) {
        printf("%s: %s\n", kNames[mode], cudaGetErrorString(err));
        std::exit(1);
      }
    }
    cudaMemcpy(hp.data(), poll, n * 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(hl.data(), land, n * 8, cudaMemcpyDeviceToHost);
    // round 0 is a cold start (instruction cache, TLB): skipped
    std::vector<double> p, l;
    for (int b = 0; b < sms; ++b)
      for (int r = 1; r < kRounds; ++r) {
        p.push_back(hp[b * kRounds + r] * ns_per_cycle);
        l.push_back(hl[b * kRounds + r] * ns_per_cycle);
      }
    std::sort(p.begin(), p.end());
    double mp = 0, ml = 0;
    for (double x : p) mp += x;
    for (double x : l) ml += x;
    printf("%-48s %9.0f %9.0f %9.0f %10.0f\n", kNames[mode], mp / p.size(), p[p.size() * 99 / 100], p.back(),
           ml / l.size());
  };
  run(rounds<kIdle>, kIdle);
  run(rounds<kLoadsAcquire>, kLoadsAcquire);
  run(rounds<kLoadsRelaxed>, kLoadsRelaxed);
  run(rounds<kLoadsOtherWarp>, kLoadsOtherWarp);
  run(rounds<kLoadsOtherWarpRelaxed>, kLoadsOtherWarpRelaxed);
  run(rounds<kBulkSmem>, kBulkSmem);
  run(rounds<kCpAsyncSmem>, kCpAsyncSmem);
  run(rounds<kBulkRows>, kBulkRows);
  run(rounds<kBulkRowsWarps>, kBulkRowsWarps);
  run(rounds<kWarp0Spared>, kWarp0Spared);
  return 0;
}

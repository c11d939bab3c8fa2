// Micro-benchmark: what running task code that is not in the SM's instruction cache costs, with
// and without the memory system full of weight streams (H100/H200). Half the SMs stream a large
// buffer (as a decode step's linear tasks do); on the other half one warp runs a block of
// kOps straight-line FFMAs (16 bytes of SASS each) twice: the first run fetches the code (from
// L2 once any SM has run it), the second runs from the instruction cache. Printed: mean and max
// ns of each run over the probing SMs, streaming or idle.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a icache_cold.cu -o icache_cold
#include <cuda/atomic>

#include <algorithm>
#include <cstdio>
#include <vector>

constexpr int kOps = 2048;  // 32 KiB of SASS: a linear task instantiation is 20–30 KiB

__device__ __noinline__ float straight_line(float a, float b) {
  float x0 = a, x1 = b, x2 = a + 1, x3 = b + 1, x4 = a + 2, x5 = b + 2, x6 = a + 3, x7 = b + 3;
#pragma unroll
  for (int i = 0; i < kOps / 8; ++i) {  // eight independent chains: issue-bound when the code is cached
    x0 = fmaf(x0, b, a); x1 = fmaf(x1, a, b); x2 = fmaf(x2, b, a); x3 = fmaf(x3, a, b);
    x4 = fmaf(x4, b, a); x5 = fmaf(x5, a, b); x6 = fmaf(x6, b, a); x7 = fmaf(x7, a, b);
  }
  return x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}

// The clock once ``dep`` is computed: a volatile shared store of it issues in order before the
// read, and it can issue only when the value is there.
__device__ __forceinline__ long long clock_after(float dep) {
  __shared__ volatile float s_dep;
  s_dep = dep;
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}

__global__ void __launch_bounds__(256, 1) probe(const uint4* big, long long words, int streaming, unsigned* go,
                                                 unsigned long long* cycles, float* sink) {
  using A = cuda::atomic_ref<unsigned, cuda::thread_scope_device>;
  const bool streamer = streaming && (blockIdx.x & 1);
  if (streamer) {  // stream until the probes are done
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (long long i = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) * 16; A(*go).load(cuda::memory_order_relaxed) < gridDim.x / 2;
         i = (i + static_cast<long long>(gridDim.x) * 256 * 16) % words) {
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const uint4 v = big[(i + u * 256) % words];
        acc.x ^= v.x; acc.y += v.y;
      }
    }
    if (acc.x == 0x12345678u) sink[blockIdx.x] = acc.y;
    return;
  }
  if (threadIdx.x >= 32) return;
  // let the streamers fill the memory system first
  const long long t_wait = clock64();
  while (clock64() - t_wait < 200000) {}
  // each clock read depends on the run before it, and each run on the read before it
  const long long t0 = clock64();
  float r = straight_line(static_cast<float>(t0 & 7), blockIdx.x);
  const long long t1 = clock_after(r);
  r += straight_line(static_cast<float>(t1 & 7), r);
  const long long t2 = clock_after(r);
  if (threadIdx.x == 0) {
    cycles[blockIdx.x * 2] = t1 - t0;
    cycles[blockIdx.x * 2 + 1] = t2 - t1;
    A(*go).fetch_add(1, cuda::memory_order_relaxed);
  }
  if (r == 1234.5f) sink[blockIdx.x] = r;
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const long long words = (2LL << 30) / 16;
  uint4* big;
  unsigned* go;
  unsigned long long* cycles;
  float* sink;
  cudaMalloc(&big, words * 16);
  cudaMemset(big, 1, words * 16);
  cudaMalloc(&go, 4);
  cudaMalloc(&cycles, sms * 16);
  cudaMalloc(&sink, sms * 4);
  std::vector<unsigned long long> h(sms * 2);
  const double ns = 1e6 / clock_khz;
  printf("%d SMs; %d straight-line FFMAs (%d KiB of code) per run\n", sms, kOps, kOps * 16 / 1024);
  printf("%-30s %10s %10s %10s %10s\n", "memory system", "cold ns", "cold max", "warm ns", "warm max");
  for (int rep = 0; rep < 2; ++rep) {  // the first launch also loads the module: its numbers are left out
    for (int streaming = 0; streaming < 2; ++streaming) {
      cudaMemset(go, 0, 4);
      cudaMemset(cycles, 0, sms * 16);
      probe<<<sms, 256>>>(big, words, streaming, go, cycles, sink);
      if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("launch failed\n");
        return 1;
      }
      cudaMemcpy(h.data(), cycles, sms * 16, cudaMemcpyDeviceToHost);
      double cold = 0, warm = 0, cold_max = 0, warm_max = 0;
      int n = 0;
      for (int b = 0; b < sms; ++b) {
        if (streaming && (b & 1)) continue;
        cold += h[b * 2] * ns;
        warm += h[b * 2 + 1] * ns;
        cold_max = std::max(cold_max, h[b * 2] * ns);
        warm_max = std::max(warm_max, h[b * 2 + 1] * ns);
        ++n;
      }
      if (rep) printf("%-30s %10.0f %10.0f %10.0f %10.0f\n", streaming ? "half the SMs streaming" : "idle", cold / n, cold_max,
                      warm / n, warm_max);
    }
  }
  return 0;
}

// Micro-benchmark: what running task code that is not in the SM's instruction cache costs, with
// and without the memory system full of weight streams (H100/H200), and how much code the SM
// keeps. One CTA per SM (its dynamic shared memory leaves no room for a second); with streaming
// on, the odd SMs stream a large buffer (as a decode step's linear tasks do) while one warp on
// each even SM runs blocks of straight-line FFMAs (16 bytes of SASS each):
//   size rows: a block of S KiB run twice — cold (fetched from L2 once any SM has run it), then
//     warm (from the SM's instruction caches if S fits them);
//   evict rows: a 16 KiB block, then E KiB of other code, then the 16 KiB block again — does a
//     layer's worth of other task code (a decode layer runs ~100 KiB of linear code) push a task's
//     code out before its next turn?
// Printed: mean and max ns of each run over the probing SMs.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a icache_cold.cu -o icache_cold
#include <cuda/atomic>

#include <algorithm>
#include <cstdio>
#include <vector>

constexpr int kSmemBytes = 160 * 1024;  // dynamic shared memory per CTA (unused): > half an SM's, so one CTA per SM

// kOps FFMAs in eight independent chains (issue-bound when the code is cached); kTag makes
// instantiations of the same size distinct code.
template <int kOps, int kTag>
__device__ __noinline__ float straight_line(float a, float b) {
  float x0 = a, x1 = b, x2 = a + kTag, x3 = b + 1, x4 = a + 2, x5 = b + 2, x6 = a + 3, x7 = b + 3;
#pragma unroll
  for (int i = 0; i < kOps / 8; ++i) {
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

__device__ __forceinline__ unsigned sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Probe body: kFirst KiB, then kMiddle KiB of other code (none if 0), then kFirst again.
template <int kFirst, int kMiddle>
__device__ __forceinline__ void probe_runs(long long* out, float seed) {
  const long long t0 = clock64();
  float r = straight_line<kFirst * 64, 0>(static_cast<float>(t0 & 7), seed);
  const long long t1 = clock_after(r);
  if constexpr (kMiddle > 0) r += straight_line<kMiddle * 64, 1>(static_cast<float>(t1 & 7), r);
  const long long t2 = clock_after(r);
  r += straight_line<kFirst * 64, 0>(static_cast<float>(t2 & 7), r);
  const long long t3 = clock_after(r);
  out[0] = t1 - t0;
  out[1] = t3 - t2;
  if (r == 1234.5f) out[2] = 1;  // keep r live
}

template <int kFirst, int kMiddle>
__global__ void __launch_bounds__(256, 1) probe(const uint4* big, long long words, int streaming, unsigned* go,
                                                 long long* cycles, unsigned* smids, float* sink) {
  using A = cuda::atomic_ref<unsigned, cuda::thread_scope_device>;
  if (threadIdx.x == 0) smids[blockIdx.x] = sm_id();
  if (streaming && (blockIdx.x & 1)) {  // stream until the probes are done
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (long long i = (static_cast<long long>(blockIdx.x) * 256 + threadIdx.x) * 16; A(*go).load(cuda::memory_order_relaxed) < gridDim.x / 2;
         i = (i + static_cast<long long>(gridDim.x) * 256 * 16) & (words - 1)) {
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        const uint4 v = big[(i + u * 256) & (words - 1)];
        acc.x ^= v.x; acc.y += v.y;
      }
    }
    if (acc.x == 0x12345678u) sink[blockIdx.x] = acc.y;
    return;
  }
  if (threadIdx.x >= 32) return;
  const long long t_wait = clock64();  // let the streamers fill the memory system first
  while (clock64() - t_wait < 200000) {}
  long long t[3];
  probe_runs<kFirst, kMiddle>(t, static_cast<float>(blockIdx.x));
  if (threadIdx.x == 0) {
    cycles[blockIdx.x * 2] = t[0];
    cycles[blockIdx.x * 2 + 1] = t[1];
    A(*go).fetch_add(1, cuda::memory_order_relaxed);
  }
}

struct Ctx {
  int sms;
  double ns_per_cycle;
  long long words;
  uint4* big;
  unsigned* go;
  long long* cycles;
  unsigned* smids;
  float* sink;
};

template <int kFirst, int kMiddle>
bool measure(const Ctx& c, const char* label) {
  cudaFuncSetAttribute(probe<kFirst, kMiddle>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  std::vector<long long> h(c.sms * 2);
  std::vector<unsigned> ids(c.sms);
  for (int rep = 0; rep < 2; ++rep) {  // the first launch also loads the code: its numbers are left out
    for (int streaming = 0; streaming < 2; ++streaming) {
      cudaMemset(c.go, 0, 4);
      probe<kFirst, kMiddle><<<c.sms, 256, kSmemBytes>>>(c.big, c.words, streaming, c.go, c.cycles, c.smids, c.sink);
      if (cudaDeviceSynchronize() != cudaSuccess) {
        printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        return false;
      }
      if (!rep) continue;
      cudaMemcpy(h.data(), c.cycles, c.sms * 16, cudaMemcpyDeviceToHost);
      cudaMemcpy(ids.data(), c.smids, c.sms * 4, cudaMemcpyDeviceToHost);
      std::sort(ids.begin(), ids.end());
      const bool one_per_sm = std::adjacent_find(ids.begin(), ids.end()) == ids.end();
      double first = 0, again = 0, first_max = 0, again_max = 0;
      int n = 0;
      for (int b = 0; b < c.sms; ++b) {
        if (streaming && (b & 1)) continue;
        const double f = h[b * 2] * c.ns_per_cycle, s = h[b * 2 + 1] * c.ns_per_cycle;
        first += f, again += s, first_max = std::max(first_max, f), again_max = std::max(again_max, s);
        ++n;
      }
      printf("%-24s %-10s %10.0f %10.0f %10.0f %10.0f%s\n", label, streaming ? "streaming" : "idle", first / n, first_max,
             again / n, again_max, one_per_sm ? "" : "  (two CTAs shared an SM)");
    }
  }
  return true;
}

int main() {
  Ctx c{};
  int clock_khz = 0;
  cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  c.ns_per_cycle = 1e6 / clock_khz;
  c.words = (2LL << 30) / 16;  // a power of two: the streamers wrap by mask
  cudaMalloc(&c.big, c.words * 16);
  cudaMemset(c.big, 1, c.words * 16);
  cudaMalloc(&c.go, 4);
  cudaMalloc(&c.cycles, c.sms * 16);
  cudaMalloc(&c.smids, c.sms * 4);
  cudaMalloc(&c.sink, c.sms * 4);
  printf("%d SMs, one CTA each; half of them streaming in the streaming rows\n", c.sms);
  printf("%-24s %-10s %10s %10s %10s %10s\n", "code", "memory", "first ns", "first max", "again ns", "again max");
  bool ok = measure<8, 0>(c, "size 8 KiB") && measure<16, 0>(c, "size 16 KiB") && measure<32, 0>(c, "size 32 KiB") &&
            measure<64, 0>(c, "size 64 KiB") && measure<128, 0>(c, "size 128 KiB") &&
            measure<16, 32>(c, "16 KiB, evict 32 KiB") && measure<16, 64>(c, "16 KiB, evict 64 KiB") &&
            measure<16, 112>(c, "16 KiB, evict 112 KiB");
  return ok ? 0 : 1;
}

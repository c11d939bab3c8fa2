// Micro-benchmark of the synchronisation primitives a runtime hop is made of (H100/H200):
// ping-pong between two CTAs on different SMs over one counter, in several flavours, and the
// cost of a device-scope fence. Prints ns per one-way hop.
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a sync_latency.cu -o sync_latency
#include <cuda/atomic>
#include <cstdio>

using A = cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>;
constexpr int kRounds = 20000;

template <int Mode>
__global__ void pingpong(unsigned long long* flag, unsigned long long* out, const int4* cold) {
  if (threadIdx.x != 0) return;
  const unsigned long long me = blockIdx.x;  // 0 or 1
  unsigned long long t0 = clock64();
  for (unsigned long long i = 0; i < kRounds; ++i) {
    const unsigned long long want = 2 * i + me;  // block 0 waits for even, block 1 for odd
    if (Mode == 0) {  // acquire polls, release store
      while (A(*flag).load(cuda::memory_order_acquire) != want) {}
      A(*flag).store(want + 1, cuda::memory_order_release);
    } else if (Mode == 1) {  // relaxed polls + fence, release store
      while (A(*flag).load(cuda::memory_order_relaxed) != want) {}
      cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
      A(*flag).store(want + 1, cuda::memory_order_release);
    } else if (Mode == 2) {  // relaxed polls + fence, release fetch_add (result used)
      while (A(*flag).load(cuda::memory_order_relaxed) != want) {}
      cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
      if (A(*flag).fetch_add(1, cuda::memory_order_acq_rel) == 0xffffffffffffULL) out[1] = 1;
    } else if (Mode == 3) {  // relaxed polls + fence, release red
      while (A(*flag).load(cuda::memory_order_relaxed) != want) {}
      cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
      A(*flag).fetch_add(1, cuda::memory_order_release);
    } else if (Mode == 4) {  // volatile polls, __threadfence + atomicAdd
      while (*(volatile unsigned long long*)flag != want) {}
      __threadfence();
      atomicAdd(flag, 1ULL);
    } else {  // acquire poll + release store, with a load still in flight at the store (a prefetch)
      while (A(*flag).load(cuda::memory_order_acquire) != want) {}
      const int4 pre = cold[(i * 977 + me * 131) % (1 << 20)];
      A(*flag).store(want + 1, cuda::memory_order_release);
      if (pre.x == 0x7fffffff) out[2] = pre.y;  // use it after the store
    }
  }
  if (me == 0) out[0] = clock64() - t0;
}

__global__ void fence_cost(unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  unsigned long long t0 = clock64();
  for (int i = 0; i < 10000; ++i) cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_device);
  out[0] = clock64() - t0;
  t0 = clock64();
  for (int i = 0; i < 10000; ++i) __syncthreads();
  out[1] = clock64() - t0;
}

int main() {
  unsigned long long *flag, *out;
  int4* cold;
  cudaMalloc(&cold, sizeof(int4) << 20);
  cudaMemset(cold, 1, sizeof(int4) << 20);
  cudaMalloc(&flag, 256);
  cudaMalloc(&out, 64);
  int clock_khz;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const char* names[] = {"acquire poll + release store", "relaxed poll + fence + release store",
                         "relaxed poll + fence + atom acq_rel", "relaxed poll + fence + red release",
                         "volatile poll + threadfence + atomicAdd", "acquire poll + release store, load in flight"};
  auto run = [&](auto kernel, const char* name) {
    for (int rep = 0; rep < 2; ++rep) {
      cudaMemset(flag, 0, 8);
      kernel<<<2, 32>>>(flag, out, cold);
      cudaError_t err = cudaDeviceSynchronize();
      if (err != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(err)); return; }
      unsigned long long cycles;
      cudaMemcpy(&cycles, out, 8, cudaMemcpyDeviceToHost);
      if (rep) printf("%-44s %7.0f ns per one-way hop\n", name, cycles / (2.0 * kRounds) / (clock_khz * 1e-6));
    }
  };
  run(pingpong<0>, names[0]);
  run(pingpong<1>, names[1]);
  run(pingpong<2>, names[2]);
  run(pingpong<3>, names[3]);
  run(pingpong<4>, names[4]);
  run(pingpong<5>, names[5]);
  fence_cost<<<1, 256>>>(out);
  cudaDeviceSynchronize();
  unsigned long long c[2];
  cudaMemcpy(c, out, 16, cudaMemcpyDeviceToHost);
  printf("%-44s %7.0f ns\n", "fence.acq_rel.gpu (no outstanding writes)", c[0] / 10000.0 / (clock_khz * 1e-6));
  printf("%-44s %7.0f ns\n", "__syncthreads (256 threads)", c[1] / 10000.0 / (clock_khz * 1e-6));
  return 0;
}

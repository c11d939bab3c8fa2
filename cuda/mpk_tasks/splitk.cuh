// Task family: split-K projections (mpk/ops/splitk.py, whose docstring is the reference).
// ``matmul_partial`` writes each K slice's fp32 product into its own plane of P [S, M, N];
// ``matmul_finish`` adds the planes in slice order, scales, adds the bias and rounds once. Both
// run one thread per output element here: correct and deterministic, not bandwidth-grade. The
// partial products of a prefill-sized GEMM (more than 16 rows, bf16 or fp16) run on the tensor
// cores instead (gemm.cuh: gemm_task's kPlanes form); a bandwidth-grade decode form (the decode
// linear over a K range) remains to build. The partial op is self-gated (the GEMM form requests
// its weights first), so the general task opens its gate itself; matmul_finish is not.
#pragma once
#include "common.cuh"

namespace mpk {

// Boundary s of K's slices (mpk.ops.splitk.slice_bounds): whole granules split evenly, the last
// slice also taking K's remainder.
__device__ __forceinline__ long long slice_bound(long long K, long long slices, long long granule, long long s) {
  return s == slices ? K : s * (K / granule) / slices * granule;
}

// out [S, M, N] (fp32, or float64 for float64 operands): out[s] = a[:, k_s] @ b[k_s, :] over
// the tile's slices, rows and columns; inputs a [M, K], b [K, N] (any strides); iparam[0] S,
// iparam[1] the granule. Each slice's terms are added in k order in fp32.
__device__ void task_matmul_partial(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (!acquire_inputs(env)) return;
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const long long K = a.shape[1], slices = c.iparam[0], granule = c.iparam[1];
  const void* pa = env.buffers[a.buffer];
  const void* pb = env.buffers[b.buffer];
  const long long n = rect_numel(r, 3);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[3];
    rect_unravel(r, 3, e, idx);
    const long long k0 = slice_bound(K, slices, granule, idx[0]), k1 = slice_bound(K, slices, granule, idx[0] + 1);
    float acc = 0.f;
    for (long long k = k0; k < k1; ++k) {
      const long long ia[2] = {idx[1], k}, ib[2] = {k, idx[2]};
      acc += load_f(pa, a.dtype, view_index(a, ia, 2)) * load_f(pb, b.dtype, view_index(b, ib, 2));
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, 3), acc);
  }
}

// The fast form of matmul_finish (variant 1: mpk.ops.splitk.finish_fast): p contiguous fp32, the
// tile's columns in whole groups of 4. A thread adds 4 adjacent columns of a row over the planes,
// for two such groups at a time, 8 planes of both loaded before the first add: one load at a time,
// a thread would wait on L2 once for every plane of every element.
__device__ __forceinline__ void matmul_finish_fast(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kGroups = 2, kPlanes = 8;
  const ViewC& p = c.in[0];
  const int slices = static_cast<int>(p.shape[0]);
  const long long N = p.shape[2], plane = p.shape[1] * N;
  const float* pp = static_cast<const float*>(env.buffers[p.buffer]) + p.offset;
  const int cols4 = static_cast<int>((r.hi[1] - r.lo[1]) / 4);
  const int n = static_cast<int>(r.hi[0] - r.lo[0]) * cols4;
  void* out = env.buffers[c.out_buffer];
  for (int e0 = threadIdx.x; e0 < n; e0 += kGroups * blockDim.x) {
    long long at[kGroups];  // each group's first element in [M, N]; −1: past the tile
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int e = e0 + g * blockDim.x;
      at[g] = e < n ? (r.lo[0] + e / cols4) * N + r.lo[1] + 4 * (e % cols4) : -1;
    }
    float acc[kGroups][4] = {};
    for (int s0 = 0; s0 < slices; s0 += kPlanes) {
      float4 v[kGroups][kPlanes];
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int j = 0; j < kPlanes; ++j)
          v[g][j] = at[g] >= 0 && s0 + j < slices ? *reinterpret_cast<const float4*>(pp + (s0 + j) * plane + at[g])
                                                  : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
#pragma unroll
        for (int j = 0; j < kPlanes; ++j) {  // in slice order (the zeros past the last slice change nothing)
          acc[g][0] += v[g][j].x;
          acc[g][1] += v[g][j].y;
          acc[g][2] += v[g][j].z;
          acc[g][3] += v[g][j].w;
        }
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (at[g] < 0) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float o = acc[g][i] * c.fparam[0];
        if (c.num_inputs > 1) {
          const ViewC& bias = c.in[1];
          const long long idx[2] = {at[g] / N, at[g] % N + i};
          o += c.fparam[1] * load_f(env.buffers[bias.buffer], bias.dtype, view_index(bias, idx, 2));
        }
        store_f(out, c.out_dtype, at[g] + i, o);
      }
    }
  }
}

// out [M, N] = fparam[0]·(p[0] + … + p[S-1]) + fparam[1]·bias: input 0 the partial products
// p [S, M, N], optional input 1 the bias broadcast to out. The planes are added in slice order,
// so the result does not depend on the order the partial tasks finished in.
__device__ void task_matmul_finish(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (c.variant == 1) {
    matmul_finish_fast(c, r, env);
    return;
  }
  const ViewC& p = c.in[0];
  const long long slices = p.shape[0];
  const void* pp = env.buffers[p.buffer];
  const long long n = rect_numel(r, 2);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[2];
    rect_unravel(r, 2, e, idx);
    float acc = 0.f;
    for (long long s = 0; s < slices; ++s) {
      const long long ip[3] = {s, idx[0], idx[1]};
      acc += load_f(pp, p.dtype, view_index(p, ip, 3));
    }
    acc *= c.fparam[0];
    if (c.num_inputs > 1) {
      const ViewC& bias = c.in[1];
      acc += c.fparam[1] * load_f(env.buffers[bias.buffer], bias.dtype, view_index(bias, idx, 2));
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, 2), acc);
  }
}

}  // namespace mpk

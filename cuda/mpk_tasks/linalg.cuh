// Task family: linear algebra. ``matmul`` (a [..., M, K] @ b [..., K, N] (+ bias), batch dims
// broadcast; one thread per output element, fp32 accumulation — the bandwidth-grade version
// is a later milestone) and ``embedding``.
#pragma once
#include "common.cuh"

namespace mpk {

// fparam[0] alpha, fparam[1] beta; optional input 2 is the bias (broadcast to the output).
__device__ void task_matmul(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const long long kdim = a.shape[a.ndim - 1];
  const long long n = rect_numel(r, c.ndim);
  const void* pa = env.buffers[a.buffer];
  const void* pb = env.buffers[b.buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims], ia[kMaxDims], ib[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    for (int d = 0; d < c.ndim; ++d) ia[d] = ib[d] = idx[d];
    float acc = 0.f;
    for (long long k = 0; k < kdim; ++k) {
      ia[c.ndim - 1] = k;
      ib[c.ndim - 2] = k;
      acc += load_f(pa, a.dtype, view_index(a, ia, c.ndim)) * load_f(pb, b.dtype, view_index(b, ib, c.ndim));
    }
    acc *= c.fparam[0];
    if (c.num_inputs > 2) {
      const ViewC& bias = c.in[2];
      acc += c.fparam[1] * load_f(env.buffers[bias.buffer], bias.dtype, view_index(bias, idx, c.ndim));
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, c.ndim), acc);
  }
}

// out[..., d] = weight[ids[...], d]; inputs weight [V, D], ids.
__device__ void task_embedding(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& w = c.in[0];
  const ViewC& ids = c.in[1];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long tok = load_i(env.buffers[ids.buffer], ids.dtype, view_index(ids, idx, c.ndim - 1));
    long long widx[2] = {tok, idx[c.ndim - 1]};
    const float v = load_f(env.buffers[w.buffer], w.dtype, view_index(w, widx, 2));
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, c.ndim), v);
  }
}

}  // namespace mpk

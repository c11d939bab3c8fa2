// Task family: convolution. ``conv`` (aten.convolution: 1 to 3 spatial dims, stride, padding,
// dilation, groups, transposed, optional bias) as a direct sum per output element, accumulated
// in float (double for float64).
#pragma once
#include "common.cuh"

namespace mpk {

// One output element (n, co, o…) of ``conv``: the sum over the group's input channels and the
// kernel positions that reach it. Forward: input position i = o·s − p + j·dil. Transposed: the
// inputs i with i·s − p + j·dil = o, i.e. j with (o + p − j·dil) divisible by s.
template <typename T>
__device__ __forceinline__ T conv_elem(const OpC& c, const TaskEnv& env, const long long* idx) {
  const ViewC& x = c.in[0];
  const ViewC& w = c.in[1];
  const bool transposed = c.iparam[0] != 0;
  const long long groups = c.iparam[1];
  const int nsp = c.ndim - 2;
  long long stride[3], pad[3], dil[3], ksize[3], nin[3];
  for (int d = 0; d < nsp; ++d) {
    const long long packed = c.iparam[2 + d];
    stride[d] = packed & 0xFFFFF;
    pad[d] = (packed >> 20) & 0xFFFFF;
    dil[d] = (packed >> 40) & 0xFFFFF;
    ksize[d] = w.shape[2 + d];
    nin[d] = x.shape[2 + d];
  }
  const long long cout_g = c.out_shape[1] / groups, cin_g = x.shape[1] / groups;
  const long long co = idx[1], g = co / cout_g;
  long long kvol = 1;
  for (int d = 0; d < nsp; ++d) kvol *= ksize[d];
  const void* xb = env.buffers[x.buffer];
  const void* wb = env.buffers[w.buffer];
  T acc = T(0);
  for (long long kk = 0; kk < kvol; ++kk) {
    long long xoff = x.offset + idx[0] * x.stride[0], woff = w.offset;
    bool inside = true;
    long long rest = kk;
    for (int d = nsp - 1; d >= 0; --d) {
      const long long j = rest % ksize[d];
      rest /= ksize[d];
      long long i;
      if (transposed) {
        const long long t = idx[2 + d] + pad[d] - j * dil[d];
        i = t / stride[d];
        inside = inside && t >= 0 && t % stride[d] == 0 && i < nin[d];
      } else {
        i = idx[2 + d] * stride[d] - pad[d] + j * dil[d];
        inside = inside && i >= 0 && i < nin[d];
      }
      xoff += i * x.stride[2 + d];
      woff += j * w.stride[2 + d];
    }
    if (!inside) continue;
    for (long long ci = 0; ci < cin_g; ++ci) {
      const long long cx = g * cin_g + ci;
      // forward w: (C_out, C_in / groups, k…); transposed w: (C_in, C_out / groups, k…)
      const long long wo = transposed ? woff + cx * w.stride[0] + (co - g * cout_g) * w.stride[1]
                                      : woff + co * w.stride[0] + ci * w.stride[1];
      acc += load_as<T>(xb, x.dtype, xoff + cx * x.stride[1]) * load_as<T>(wb, w.dtype, wo);
    }
  }
  if (c.num_inputs == 3) {
    const ViewC& b = c.in[2];
    acc += load_as<T>(env.buffers[b.buffer], b.dtype, b.offset + co * b.stride[0]);
  }
  return acc;
}

// out = convolution(x, w, bias): inputs x (N, C_in, spatial…), w, optionally bias (C_out,).
// iparam[0] 1: transposed; [1] groups; [2 + d] spatial dim d's stride | padding << 20 |
// dilation << 40 (mpk.ops.conv.conv_params). One thread per output element.
__device__ void task_conv(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    if (c.out_dtype == kF64) store_as<double>(out, c.out_dtype, o, conv_elem<double>(c, env, idx));
    else store_as<float>(out, c.out_dtype, o, conv_elem<float>(c, env, idx));
  }
}

}  // namespace mpk

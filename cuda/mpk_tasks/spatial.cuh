// Task family: spatial ops of convolutional networks. ``pool``: max and average pooling over the
// last 1 to 3 dims (kernel, stride, padding, dilation, count_include_pad, divisor_override) and
// adaptive pooling, accumulated in float (double for float64).
#pragma once
#include "common.cuh"

namespace mpk {

// Output position o's window along one spatial dim (mpk.ops.spatial.pool_window): positions lo,
// lo + step, … below hi, and the count an average divides by along it.
struct PoolWindow {
  long long lo, hi, step, count;
};

__device__ __forceinline__ PoolWindow pool_window(long long packed, bool avg, bool adaptive, bool count_pad,
                                                  long long o, long long n_in, long long n_out) {
  PoolWindow win;
  if (adaptive) {
    win.lo = o * n_in / n_out;
    win.hi = ((o + 1) * n_in + n_out - 1) / n_out;
    win.step = 1;
    win.count = win.hi - win.lo;
    return win;
  }
  const long long k = packed & 0xFFFF, s = (packed >> 16) & 0xFFFF, p = (packed >> 32) & 0xFFFF,
                  dil = (packed >> 48) & 0xFFFF;
  const long long start = o * s - p;
  if (!avg) {
    win.lo = start < 0 ? start + (-start + dil - 1) / dil * dil : start;
    win.hi = min(start + (k - 1) * dil + 1, n_in);
    win.step = dil;
    win.count = 1;
    return win;
  }
  const long long end = min(start + k, n_in + p);
  win.lo = max(start, 0LL);
  win.hi = min(end, n_in);
  win.step = 1;
  win.count = count_pad ? end - start : win.hi - win.lo;
  return win;
}

template <typename T>
__device__ __forceinline__ T pool_elem(const OpC& c, const TaskEnv& env, const long long* idx) {
  const ViewC& x = c.in[0];
  const bool avg = c.iparam[0] != 0, adaptive = c.iparam[1] != 0, count_pad = c.iparam[2] != 0;
  const long long divisor = c.iparam[3];
  const int nsp = static_cast<int>(c.iparam[4]), lead = c.ndim - nsp;
  PoolWindow win[3];
  long long span[3], total = 1, count = 1;
  for (int d = 0; d < nsp; ++d) {
    win[d] = pool_window(c.iparam[5 + d], avg, adaptive, count_pad, idx[lead + d], x.shape[lead + d],
                         c.out_shape[lead + d]);
    span[d] = win[d].hi > win[d].lo ? (win[d].hi - win[d].lo + win[d].step - 1) / win[d].step : 0;
    total *= span[d];
    count *= win[d].count;
  }
  long long base = x.offset;
  for (int d = 0; d < lead; ++d) base += (x.shape[d] == 1 ? 0 : idx[d]) * x.stride[d];
  const void* xb = env.buffers[x.buffer];
  T acc = avg ? T(0) : T(-INFINITY);
  for (long long k = 0; k < total; ++k) {
    long long off = base, rest = k;
    for (int d = nsp - 1; d >= 0; --d) {
      off += (win[d].lo + rest % span[d] * win[d].step) * x.stride[lead + d];
      rest /= span[d];
    }
    const T v = load_as<T>(xb, x.dtype, off);
    if (avg) acc += v;
    else if (v > acc || v != v) acc = v;  // NaN propagates, as torch's max pooling
  }
  return avg ? acc / T(divisor ? divisor : count) : acc;
}

// out = max or average pooling of x over its last iparam[4] dims. iparam[0] 1: average (0: max);
// [1] 1: adaptive; [2] count_include_pad; [3] divisor_override (0: none); [5 + d] spatial dim
// d's kernel | stride << 16 | padding << 32 | dilation << 48 (mpk.ops.spatial.pool_params). One
// thread per output element.
__device__ void task_pool(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    if (c.out_dtype == kF64) store_as<double>(out, c.out_dtype, o, pool_elem<double>(c, env, idx));
    else store_as<float>(out, c.out_dtype, o, pool_elem<float>(c, env, idx));
  }
}

}  // namespace mpk

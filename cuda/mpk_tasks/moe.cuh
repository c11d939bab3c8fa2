// Task family: mixture-of-experts routing (mpk/ops/moe.py). ``rounded_div`` (floor / trunc
// division), ``one_hot`` (the expert mask),
// ``histogram`` (torch.histc, and torch.bincount with a static bin count) and ``expert_matmul``
// (the grouped expert GEMM: a batched matmul whose one operand is the expert weight picked per
// row by a run-time index).
#pragma once
#include "common.cuh"

namespace mpk {

// a / b rounded toward -inf, as PyTorch's div_floor_floating: from the exact remainder, so a
// quotient whose rounding reaches the next integer is not floored past it (1 // 0.1 = 9).
template <typename T>
__device__ __forceinline__ T floor_div_float(T a, T b) {
  if (b == T(0)) return a / b;
  const T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != T(0) && (b < T(0)) != (mod < T(0))) div -= T(1);
  if (div == T(0)) return copysign(T(0), a / b);
  T floordiv = floor(div);
  if (div - floordiv > T(0.5)) floordiv += T(1);
  return floordiv;
}

// out = a / b rounded toward -inf (iparam[0] 0) or toward 0 (1), a and b broadcast, in the
// output's dtype: integers exactly (a zero divisor gives 0), floats in float (double for float64).
__device__ void task_rounded_div(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const bool floor_mode = c.iparam[0] == 0;
  void* out = env.buffers[c.out_buffer];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    const long long ia = view_index(a, idx, c.ndim), ib = view_index(b, idx, c.ndim);
    if (is_int(c.out_dtype)) {
      const long long x = load_i(env.buffers[a.buffer], a.dtype, ia), y = load_i(env.buffers[b.buffer], b.dtype, ib);
      long long q = y == 0 ? 0 : x / y;  // C++ divides toward 0
      if (floor_mode && y != 0 && x % y != 0 && ((x < 0) != (y < 0))) q -= 1;
      store_i(out, c.out_dtype, o, q);
    } else if (c.out_dtype == kF64) {
      const double x = load_d(env.buffers[a.buffer], a.dtype, ia), y = load_d(env.buffers[b.buffer], b.dtype, ib);
      store_f(out, c.out_dtype, o, floor_mode ? floor_div_float(x, y) : trunc(x / y));
    } else {
      const float x = load_f(env.buffers[a.buffer], a.dtype, ia), y = load_f(env.buffers[b.buffer], b.dtype, ib);
      store_f(out, c.out_dtype, o, floor_mode ? floor_div_float(x, y) : truncf(x / y));
    }
  }
}

// out[…, c] = (x[…] == c). An index outside [0, classes) is reported (kBadIndex) and its row
// written as 0.
__device__ void task_one_hot(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const long long classes = c.out_shape[c.ndim - 1];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    const long long v = load_i(env.buffers[x.buffer], x.dtype, view_index(x, idx, c.ndim - 1));
    if ((v < 0 || v >= classes) && idx[c.ndim - 1] == 0)
      report_bad_input(kBadIndex, c.out_buffer, ravel(idx, c.out_shape, c.ndim - 1), v, classes);
    store_i(env.buffers[c.out_buffer], c.out_dtype, o, v == idx[c.ndim - 1] ? 1 : 0);
  }
}

// The k-th element (row-major) of a view, whatever its strides.
__device__ __forceinline__ long long view_element(const ViewC& v, long long k) {
  long long off = v.offset;
  for (int d = v.ndim - 1; d >= 0; --d) {
    off += (k % v.shape[d]) * v.stride[d];
    k /= v.shape[d];
  }
  return off;
}

__device__ __forceinline__ long long view_numel(const ViewC& v) {
  long long n = 1;
  for (int d = 0; d < v.ndim; ++d) n *= v.shape[d];
  return n;
}

// Each thread owns bins of the tile and folds every entry into them in entry order (eager's
// CPU order, so a weighted float sum rounds as eager's does). iparam[0]: 0 histc, 1 bincount;
// iparam[1], [2]: histc's min and max as float64 bits (equal: the data's min and max).
// histc: bin = (int)((v - min) * bins / (max - min)) in the input's float arithmetic, v == max in
// the last bin, values outside [min, max] skipped. bincount: the value is the bin; one outside
// [0, bins) is reported (kBadIndex) and skipped; in[1] (if any) holds the weights.
__device__ void task_histogram(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const void* xb = env.buffers[x.buffer];
  const long long bins = c.out_shape[0], entries = view_numel(x);
  const bool histc = c.iparam[0] == 0;
  float lo = static_cast<float>(__longlong_as_double(c.iparam[1]));
  float hi = static_cast<float>(__longlong_as_double(c.iparam[2]));
  if (histc && lo == hi) {  // the data's range (every thread scans it: entries are few in routing)
    lo = INFINITY;
    hi = -INFINITY;
    for (long long k = 0; k < entries; ++k) {
      const float v = load_f(xb, x.dtype, view_element(x, k));
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    if (lo == hi) {
      lo -= 1.f;
      hi += 1.f;
    }
  }
  const bool f64 = c.out_dtype == kF64;
  for (long long b = r.lo[0] + threadIdx.x; b < r.hi[0]; b += blockDim.x) {
    double sum = 0.0;
    float sumf = 0.f;
    for (long long k = 0; k < entries; ++k) {
      long long bin;
      if (histc) {
        const float v = load_f(xb, x.dtype, view_element(x, k));
        if (!(v >= lo && v <= hi)) continue;  // outside the range, or NaN
        bin = static_cast<long long>((v - lo) * static_cast<float>(bins) / (hi - lo));
        if (bin == bins) bin -= 1;
      } else {
        bin = load_i(xb, x.dtype, view_element(x, k));
        if (bin < 0 || bin >= bins) {
          if (b == r.lo[0]) report_bad_input(kBadIndex, c.out_buffer, k, bin, bins);
          continue;
        }
      }
      if (bin != b) continue;
      if (c.num_inputs > 1) {
        const ViewC& w = c.in[1];
        const long long at = view_element(w, k);
        if (f64) sum += load_d(env.buffers[w.buffer], w.dtype, at);
        else sumf += load_f(env.buffers[w.buffer], w.dtype, at);
      } else {
        sum += 1.0;
        sumf += 1.f;
      }
    }
    if (is_int(c.out_dtype)) store_i(env.buffers[c.out_buffer], c.out_dtype, b, static_cast<long long>(sum));
    else if (f64) store_f(env.buffers[c.out_buffer], c.out_dtype, b, sum);
    else store_f(env.buffers[c.out_buffer], c.out_dtype, b, sumf);
  }
}

// out[s, m, n] = Σ_k A_s[m, k] · B_s[k, n] with A_s = a[index[s]] (iparam[0] == 0) or a[s], B_s =
// b[index[s]] (iparam[0] == 1) or b[s]: the expert's weight read where it sits. One warp per
// output element, its lanes striding over k (coalesced along a weight row stored k-contiguous,
// as nn.Linear-style expert weights are), fp32 accumulation (float64 for a float64 output). A
// negative index counts from the end (W[index]); one outside the experts is reported (kBadIndex)
// and its rows written as 0.
__device__ void task_expert_matmul(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const ViewC& index = c.in[2];
  const int gathered = static_cast<int>(c.iparam[0]);
  const long long experts = (gathered == 0 ? a : b).shape[0], K = a.shape[2];
  const bool f64 = c.out_dtype == kF64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const void* ab = env.buffers[a.buffer];
  const void* bb = env.buffers[b.buffer];
  void* out = env.buffers[c.out_buffer];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = warp; e < n; e += warps) {  // e is warp-uniform: the shuffles below see every lane
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    const long long s = idx[0];
    const long long given = load_i(env.buffers[index.buffer], index.dtype, index.offset + s * index.stride[0]);
    const long long expert = given < 0 ? given + experts : given;
    if (expert < 0 || expert >= experts) {
      if (lane == 0) {
        if (idx[1] == 0 && idx[2] == 0) report_bad_input(kBadIndex, c.out_buffer, s, given, experts);
        store_i(out, c.out_dtype, o, 0);
      }
      continue;
    }
    const long long ra = gathered == 0 ? expert : s, rb = gathered == 1 ? expert : s;
    const long long a0 = a.offset + ra * a.stride[0] + idx[1] * a.stride[1];
    const long long b0 = b.offset + rb * b.stride[0] + idx[2] * b.stride[2];
    if (f64) {
      double acc = 0.0;
      for (long long k = lane; k < K; k += 32)
        acc += load_d(ab, a.dtype, a0 + k * a.stride[2]) * load_d(bb, b.dtype, b0 + k * b.stride[1]);
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) store_f(out, c.out_dtype, o, acc);
    } else {
      float acc = 0.f;
      for (long long k = lane; k < K; k += 32)
        acc = fmaf(load_f(ab, a.dtype, a0 + k * a.stride[2]), load_f(bb, b.dtype, b0 + k * b.stride[1]), acc);
      acc = warp_sum(acc);
      if (lane == 0) store_f(out, c.out_dtype, o, acc);
    }
  }
}

}  // namespace mpk

// Task family: data movement. ``copy`` (out = reshape(view, out_shape): the i-th element in
// row-major order of the output is the i-th of the input view), ``cat`` along a dim and
// ``gather`` (torch.gather; index_select and x[idx] lower to it), ``triangle`` (tril / triu), and
// the scatter-style updates whose output is a base tensor with elements replaced: ``slice_scatter``
// and ``scatter``.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void task_copy(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims], src[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    long long f = ravel(idx, c.out_shape, c.ndim);
    const long long o = f;
    for (int d = x.ndim - 1; d >= 0; --d) {
      src[d] = f % x.shape[d];
      f /= x.shape[d];
    }
    long long off = x.offset;
    for (int d = 0; d < x.ndim; ++d) off += src[d] * x.stride[d];
    move_elem(env.buffers[x.buffer], x.dtype, off, env.buffers[c.out_buffer], c.out_dtype, o);
  }
}

// iparam[0]: the cat dim.
__device__ void task_cat(const OpC& c, const Rect& r, const TaskEnv& env) {
  const int dim = static_cast<int>(c.iparam[0]);
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    long long pos = idx[dim];
    int i = 0;
    while (pos >= c.in[i].shape[dim]) pos -= c.in[i++].shape[dim];
    idx[dim] = pos;
    const ViewC& x = c.in[i];
    move_elem(env.buffers[x.buffer], x.dtype, view_index(x, idx, c.ndim), env.buffers[c.out_buffer], c.out_dtype, o);
  }
}

// out[a…, b…, c…] = x[a…, index_0[a…, b…, c…], …, index_{k-1}[…], c…]: the k index inputs
// (views of the output's shape) pick x's dims d0 … d0+k-1, their common shape filling the
// output's dims d0 … d0+nb-1 (torch.gather: k = nb = 1). iparam[0] d0, iparam[1] = 1: negative
// indices count from the end. An index outside its dim is reported (kBadIndex) and its element
// written as 0: a bad index never reads outside x.
__device__ void task_gather(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const int d0 = static_cast<int>(c.iparam[0]), k = c.num_inputs - 1, nb = c.ndim - (x.ndim - k);
  const long long count = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < count; e += blockDim.x) {
    long long idx[kMaxDims], src[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    bool ok = true;
    for (int d = 0; d < d0; ++d) src[d] = idx[d];
    for (int j = 0; j < k && ok; ++j) {
      const ViewC& index = c.in[1 + j];
      const long long n = x.shape[d0 + j];
      const long long given = load_i(env.buffers[index.buffer], index.dtype, view_index(index, idx, c.ndim));
      const long long t = c.iparam[1] && given < 0 ? given + n : given;
      if (t < 0 || t >= n) {
        report_bad_input(kBadIndex, c.out_buffer, o, given, n);
        ok = false;
      }
      src[d0 + j] = t;
    }
    if (!ok) {
      store_i(env.buffers[c.out_buffer], c.out_dtype, o, 0);
      continue;
    }
    for (int d = d0 + k; d < x.ndim; ++d) src[d] = idx[d - k + nb];
    move_elem(env.buffers[x.buffer], x.dtype, view_index(x, src, x.ndim), env.buffers[c.out_buffer], c.out_dtype, o);
  }
}

// out = base with out[…, start + k·step, …] = src[…, k, …] along the dim. iparam: dim, start, step.
__device__ void task_slice_scatter(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& base = c.in[0];
  const ViewC& src = c.in[1];
  const int dim = static_cast<int>(c.iparam[0]);
  const long long start = c.iparam[1], step = c.iparam[2];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    const long long p = idx[dim] - start;
    if (p >= 0 && p % step == 0 && p / step < src.shape[dim]) {
      idx[dim] = p / step;
      move_elem(env.buffers[src.buffer], src.dtype, view_index(src, idx, c.ndim), env.buffers[c.out_buffer],
                c.out_dtype, o);
    } else {
      move_elem(env.buffers[base.buffer], base.dtype, view_index(base, idx, c.ndim), env.buffers[c.out_buffer],
                c.out_dtype, o);
    }
  }
}

enum ScatterReduce : int {
  kScatterNone = 0, kScatterSum = 1, kScatterAmax = 2, kScatterAmin = 3, kScatterProd = 4, kScatterMean = 5
};

// One output element of ``scatter``: base's value with every entry that lands on it folded in,
// in entry order (eager's loop), in T (float for float32 and 16-bit floats, double for float64,
// long long for integers, exactly). Mean: the sum over the entries (and base's value with
// include_self) divided by their count, integers by floor division as eager's; a 16-bit mean
// sums in float and rounds once, where eager's 16-bit path rounds in an order of its own (a
// rounding step or two apart).
template <typename T>
__device__ __forceinline__ void scatter_elem(const OpC& c, const TaskEnv& env, long long* idx, long long o) {
  const ViewC& base = c.in[0];
  const ViewC& index = c.in[1];
  const ViewC& src = c.in[2];
  const int dim = static_cast<int>(c.iparam[0]), reduce = static_cast<int>(c.iparam[1]);
  const bool include_self = c.iparam[2], line = c.iparam[3], wrap = c.iparam[4];
  const long long target = idx[dim], n = c.out_shape[dim];
  T acc = load_as<T>(env.buffers[base.buffer], base.dtype, view_index(base, idx, c.ndim));
  bool hit = false;
  long long count = include_self ? 1 : 0;  // mean's divisor
  bool inside = true;  // an element-wise index covers this output line (it may be smaller than base)
  if (!line)
    for (int d = 0; d < c.ndim; ++d) inside = inside && (d == dim || idx[d] < index.shape[d]);
  const long long entries = inside ? index.shape[line ? 0 : dim] : 0;
  for (long long j = 0; j < entries; ++j) {
    long long at[kMaxDims];
    for (int d = 0; d < c.ndim; ++d) at[d] = idx[d];
    at[dim] = j;
    const long long given = load_i(env.buffers[index.buffer], index.dtype,
                                   line ? index.offset + j * index.stride[0] : view_index(index, at, c.ndim));
    const long long t = wrap && given < 0 ? given + n : given;
    if (t < 0 || t >= n) {
      if (target == 0) report_bad_input(kBadIndex, c.out_buffer, j, given, n);  // once per line
      continue;
    }
    if (t != target) continue;
    const T v = load_as<T>(env.buffers[src.buffer], src.dtype, view_index(src, at, c.ndim));
    if (!hit && !include_self) {  // eager starts such an element from the reduction's identity
      if (reduce == kScatterSum || reduce == kScatterMean) acc = T(0);
      else if (reduce == kScatterProd) acc = T(1);
      else if (reduce != kScatterNone) acc = v;
    }
    hit = true;
    ++count;
    if (reduce == kScatterNone) acc = v;
    else if (reduce == kScatterSum || reduce == kScatterMean) acc = acc + v;
    else if (reduce == kScatterProd) acc = acc * v;
    else if (reduce == kScatterAmax) acc = (v > acc || v != v) ? v : acc;  // NaN propagates, as torch's max
    else acc = (v < acc || v != v) ? v : acc;
    // a 1-D index (index_add, index_put) rounds a 16-bit sum to its dtype at every step, as
    // eager's loop does; torch.scatter_add / scatter_reduce sum in float and round once
    if constexpr (std::is_same_v<T, float>)
      if (line) acc = round_to(c.out_dtype, acc);
  }
  if (reduce == kScatterMean && hit) {
    if constexpr (std::is_same_v<T, long long>) {
      const long long q = acc / count;  // floor division, as eager's integer mean
      acc = q - ((acc % count != 0) && ((acc < 0) != (count < 0)) ? 1 : 0);
    } else {
      acc = acc / static_cast<T>(count);
    }
  }
  store_as<T>(env.buffers[c.out_buffer], c.out_dtype, o, acc);
}

// out = base with src's entries folded into out[…, index[…], …] along the dim (torch.scatter,
// scatter_add, scatter_reduce; index_put and index_add as a 1-D index whose entry j carries src's
// slice j). A tile holds whole lines along the dim, so each element folds its own entries, in
// order, with no atomics. iparam: dim, reduce (ScatterReduce), include_self, 1-D index, wrap
// negative indices. An index outside the dim is reported (kBadIndex) and its entry skipped.
__device__ void task_scatter(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    if (is_int(c.out_dtype) || c.out_dtype == kBool) scatter_elem<long long>(c, env, idx, o);
    else if (c.out_dtype == kF64) scatter_elem<double>(c, env, idx, o);
    else scatter_elem<float>(c, env, idx, o);
  }
}

// tril / triu over the last two dims: an element (…, i, j) is x's where j - i is on the kept side
// of the diagonal, else 0. iparam[0] the diagonal, iparam[1] 1: triu (j - i >= diagonal), 0: tril
// (j - i <= diagonal).
__device__ void task_triangle(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const long long diagonal = c.iparam[0];
  const bool upper = c.iparam[1] != 0;
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long o = ravel(idx, c.out_shape, c.ndim);
    const long long offset = idx[c.ndim - 1] - idx[c.ndim - 2];
    if (upper ? offset >= diagonal : offset <= diagonal)
      move_elem(env.buffers[x.buffer], x.dtype, view_index(x, idx, c.ndim), out, c.out_dtype, o);
    else
      store_i(out, c.out_dtype, o, 0);  // 0 in any dtype (+0.0 for floats, false for bools)
  }
}

}  // namespace mpk

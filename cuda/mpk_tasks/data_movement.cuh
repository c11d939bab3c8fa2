// Task family: data movement. ``copy`` (out = reshape(view, out_shape): the i-th element in
// row-major order of the output is the i-th of the input view), ``cat`` along a dim and
// ``gather`` (torch.gather; index_select and x[idx] lower to it) and ``triangle`` (tril / triu).
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

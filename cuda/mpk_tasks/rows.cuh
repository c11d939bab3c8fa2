// Task family: row-wise ops, one warp per output row (the whole last dim): reduce
// (sum/mean/amax/argmax/amin/argmin), softmax and its log, layer_norm, rms_norm, rope.
#pragma once
#include "common.cuh"

namespace mpk {

enum ReduceFn : int { kSum, kMean, kAmax, kArgmax, kAmin, kArgmin };  // the order of mpk.ops.rows.REDUCE_FNS

// amin and argmin are amax and argmax of the negated values (exact: negation only flips the
// sign bit; the first NaN and the first of equal values keep their places).
__host__ __device__ constexpr int unsigned_fn(int fn) { return fn == kAmin ? kAmax : fn == kArgmin ? kArgmax : fn; }
__host__ __device__ constexpr bool negated_fn(int fn) { return fn == kAmin || fn == kArgmin; }

// Rows of the tile: the rect over all dims but the last (whose extent is the row length).
#define MPK_FOR_ROWS(c, r, idx)                                                         \
  const int lane = threadIdx.x & 31;                                                    \
  const long long nrows = rect_numel(r, (c).ndim - 1);                                  \
  for (long long row = threadIdx.x >> 5; row < nrows; row += blockDim.x >> 5)           \
    if (long long idx[kMaxDims]; (rect_unravel(r, (c).ndim - 1, row, idx), true))

__device__ __forceinline__ float ld(const OpC& c, const TaskEnv& env, int input, long long* idx) {
  const ViewC& v = c.in[input];
  return load_f(env.buffers[v.buffer], v.dtype, view_index(v, idx, c.ndim));
}

// Whether (ov, oa) comes before (acc, arg) in torch.argmax's order: the first NaN, else the
// first largest value.
__device__ __forceinline__ bool argmax_before(float ov, long long oa, float acc, long long arg) {
  const bool o_nan = ov != ov, a_nan = acc != acc;
  return o_nan ? (!a_nan || oa < arg) : (!a_nan && (ov > acc || (ov == acc && oa < arg)));
}

// One element (value v at index j) into a running argmax whose indices so far are all below j.
__device__ __forceinline__ void argmax_add(float& acc, long long& arg, float v, long long j) {
  if (v > acc || (v != v && acc == acc)) {
    acc = v;
    arg = j;
  }
}

__device__ __forceinline__ void warp_argmax(float& acc, long long& arg) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, acc, o);
    const long long oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (argmax_before(ov, oa, acc, arg)) {
      acc = ov;
      arg = oa;
    }
  }
}

// reduce of integer or bool rows in 64-bit integers, exact as torch's (a float32 sum would round
// past 2^24); amin and argmin through ~v, which reverses the order without overflow.
__device__ __noinline__ void reduce_int(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  const bool neg = negated_fn(static_cast<int>(c.iparam[1]));
  const int fn = unsigned_fn(static_cast<int>(c.iparam[1]));
  const long long len = x.shape[x.ndim - 1];
  const int out_rows_ndim = c.iparam[0] ? c.ndim - 1 : c.ndim;
  const int lane = threadIdx.x & 31;
  const long long nrows = rect_numel(r, out_rows_ndim);
  for (long long row = threadIdx.x >> 5; row < nrows; row += blockDim.x >> 5) {
    long long idx[kMaxDims];
    rect_unravel(r, out_rows_ndim, row, idx);
    long long acc = 0, arg = len;  // arg = len: no element yet
    for (long long j = lane; j < len; j += 32) {
      idx[x.ndim - 1] = j;
      const long long e = load_i(env.buffers[x.buffer], x.dtype, view_index(x, idx, x.ndim)), v = neg ? ~e : e;
      if (fn == kSum) acc += v;
      else if (arg == len || v > acc) acc = v, arg = j;  // the first largest: j rises
    }
    for (int o = 16; o > 0; o >>= 1) {
      const long long ov = __shfl_xor_sync(0xffffffffu, acc, o), oa = __shfl_xor_sync(0xffffffffu, arg, o);
      if (fn == kSum) acc += ov;
      else if (oa < len && (arg == len || ov > acc || (ov == acc && oa < arg))) acc = ov, arg = oa;
    }
    if (lane == 0) {
      if (c.iparam[0]) idx[c.ndim - 1] = 0;
      store_i(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, c.ndim),
              fn == kArgmax ? arg : neg ? ~acc : acc);
    }
  }
}

// reduce: the input has the output's leading dims plus the reduced last dim. iparam[0] keepdim,
// iparam[1] the function (ReduceFn). One warp per row, any view and dtype (integers and bools:
// reduce_int); long contiguous rows take reduce_rows below.
__device__ void task_reduce(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& x = c.in[0];
  if (is_int(x.dtype) || x.dtype == kBool) {
    reduce_int(c, r, env);
    return;
  }
  const bool neg = negated_fn(static_cast<int>(c.iparam[1]));
  const int fn = unsigned_fn(static_cast<int>(c.iparam[1]));
  const int lead = x.ndim - 1;
  const long long len = x.shape[x.ndim - 1];
  const int out_rows_ndim = c.iparam[0] ? c.ndim - 1 : c.ndim;  // keepdim leaves a size-1 dim
  const int lane = threadIdx.x & 31;
  const long long nrows = rect_numel(r, out_rows_ndim);
  for (long long row = threadIdx.x >> 5; row < nrows; row += blockDim.x >> 5) {
    long long idx[kMaxDims];
    rect_unravel(r, out_rows_ndim, row, idx);
    float acc = fn == kAmax || fn == kArgmax ? -INFINITY : 0.f;
    long long arg = 0;
    for (long long j = lane; j < len; j += 32) {
      idx[lead] = j;
      const float e = load_f(env.buffers[x.buffer], x.dtype, view_index(x, idx, x.ndim)), v = neg ? -e : e;
      if (fn == kArgmax) argmax_add(acc, arg, v, j);
      else if (fn == kAmax) acc = max_nan(acc, v);  // NaN propagates like torch
      else acc += v;
    }
    if (fn == kArgmax) warp_argmax(acc, arg);
    else acc = fn == kAmax ? warp_max_nan(acc) : warp_sum(acc);
    if (lane == 0) {
      if (c.iparam[0]) idx[c.ndim - 1] = 0;
      const long long o = ravel(idx, c.out_shape, c.ndim);
      if (fn == kArgmax) store_i(env.buffers[c.out_buffer], c.out_dtype, o, arg);
      else store_f(env.buffers[c.out_buffer], c.out_dtype, o, fn == kMean ? acc / len : neg ? -acc : acc);
    }
  }
}

// --- long contiguous rows: the whole CTA on one row ------------------------------------------
// reduce_rows and softmax_rows serve rows of at least mpk.ops.rows.LONG_ROW elements that are
// contiguous and in whole 16-byte words (codegen: row_vector_ctype) — a vocabulary of logits:
// greedy decoding's argmax, sampling's softmax. One warp walking 150 K elements with scalar
// loads keeps too few bytes in flight; here every thread keeps kRowInFlight 16-byte loads in
// flight (64 KiB per CTA) and the partition gives each such row a task of its own.
constexpr int kRowInFlight = 16;

// f(e, j) for every 16-byte word of the contiguous row at p (len elements, a multiple of the
// word's kE) that this thread owns: e its kE elements as floats, j the index of e[0]. A thread
// sees its words in increasing index order. Rounds of kRowInFlight words are double-buffered:
// the next round's loads go out before f runs over the current one, so the SM's loads do not
// drain while it computes.
template <typename T, typename F>
__device__ __forceinline__ void for_row_words(const T* p, long long len, F f) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T));
  const uint4* pv = reinterpret_cast<const uint4*>(p);
  const long long words = len / kE, step = blockDim.x;
  const auto load = [&](uint4 (&raw)[kRowInFlight], long long w0) {
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) raw[u] = w0 + u * step < words ? pv[w0 + u * step] : make_uint4(0, 0, 0, 0);
  };
  uint4 cur[kRowInFlight], nxt[kRowInFlight];
  load(cur, threadIdx.x);
  for (long long w0 = threadIdx.x; w0 < words; w0 += kRowInFlight * step) {
    load(nxt, w0 + kRowInFlight * step);
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) {
      if (w0 + u * step >= words) break;
      float e[kE];
      load_vec<kE>(reinterpret_cast<const T*>(&cur[u]), e);
      f(e, (w0 + u * step) * kE);
    }
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) cur[u] = nxt[u];
  }
}

// The start of the input row (and its output element's index) of row `row` of the tile: the
// leading indices of the output tile, the reduced dim at 0.
__device__ __forceinline__ long long row_start(const OpC& c, const Rect& r, int rows_ndim, long long row,
                                               long long* idx) {
  const ViewC& x = c.in[0];
  rect_unravel(r, rows_ndim, row, idx);
  idx[x.ndim - 1] = 0;
  return view_index(x, idx, x.ndim);
}

// A partial result (v, a) of reduction kFn into (acc, arg): sums add after acc, an argmax
// keeps the first NaN or the first largest value by index.
template <int kFn>
__device__ __forceinline__ void fold_partial(float& acc, long long& arg, float v, long long a) {
  if constexpr (kFn == kArgmax) {
    if (argmax_before(v, a, acc, arg)) {
      acc = v;
      arg = a;
    }
  } else {
    acc = kFn == kAmax ? max_nan(acc, v) : acc + v;
  }
}

// reduce over long rows (kFn a ReduceFn); each thread folds its words into kE accumulators,
// one per position in a word (independent chains: one running value would be a dependency chain of
// ~130 steps per round of loads, which kept the next round's loads waiting), adds those in
// order, the warps reduce with shuffles and thread 0 folds the warps in warp order (sums are
// deterministic).
template <typename T, int kStoredFn>
__device__ __noinline__ void reduce_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kFn = unsigned_fn(kStoredFn);
  constexpr bool kNeg = negated_fn(kStoredFn);
  constexpr int kE = 16 / static_cast<int>(sizeof(T));
  const ViewC& x = c.in[0];
  const long long len = x.shape[x.ndim - 1];
  const int rows_ndim = c.iparam[0] ? c.ndim - 1 : c.ndim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* red = scratch();
  long long* red_arg = reinterpret_cast<long long*>(red + 32);
  const long long nrows = rect_numel(r, rows_ndim);
  for (long long row = 0; row < nrows; ++row) {
    long long idx[kMaxDims];
    const T* p = static_cast<const T*>(env.buffers[x.buffer]) + row_start(c, r, rows_ndim, row, idx);
    float accs[kE];
    long long args[kE];  // kArgmax: accumulator i holds elements i of the words, in index order
#pragma unroll
    for (int i = 0; i < kE; ++i) {
      accs[i] = kFn == kAmax || kFn == kArgmax ? -INFINITY : 0.f;
      args[i] = 0;
    }
    for_row_words<T>(p, len, [&](const float (&e)[kE], long long j) {
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        const float v = kNeg ? -e[i] : e[i];
        if constexpr (kFn == kArgmax) argmax_add(accs[i], args[i], v, j + i);
        else if constexpr (kFn == kAmax) accs[i] = max_nan(accs[i], v);
        else accs[i] += v;
      }
    });
    float acc = accs[0];
    long long arg = args[0];
#pragma unroll
    for (int i = 1; i < kE; ++i) fold_partial<kFn>(acc, arg, accs[i], args[i]);
    if constexpr (kFn == kArgmax) warp_argmax(acc, arg);
    else acc = kFn == kAmax ? warp_max_nan(acc) : warp_sum(acc);
    if (lane == 0) {
      red[warp] = acc;
      red_arg[warp] = arg;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      acc = red[0];
      arg = red_arg[0];
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) fold_partial<kFn>(acc, arg, red[w], red_arg[w]);
      if (c.iparam[0]) idx[c.ndim - 1] = 0;
      const long long o = ravel(idx, c.out_shape, c.ndim);
      if constexpr (kFn == kArgmax) store_i(env.buffers[c.out_buffer], c.out_dtype, o, arg);
      else store_f(env.buffers[c.out_buffer], c.out_dtype, o, kFn == kMean ? acc / len : kNeg ? -acc : acc);
    }
    __syncthreads();  // red is rewritten by the next row
  }
}

// softmax over the last dim; iparam[0] = 1: its log, (x − max) − log Σ e^(x − max).
__device__ void task_softmax(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long len = c.out_shape[c.ndim - 1];
  const bool log = c.iparam[0];
  void* out = env.buffers[c.out_buffer];
  MPK_FOR_ROWS(c, r, idx) {
    float m = -INFINITY;
    for (long long j = lane; j < len; j += 32) { idx[c.ndim - 1] = j; m = fmaxf(m, ld(c, env, 0, idx)); }
    m = warp_max(m);
    float s = 0.f;
    for (long long j = lane; j < len; j += 32) { idx[c.ndim - 1] = j; s += expf(ld(c, env, 0, idx) - m); }
    s = warp_sum(s);
    const float log_s = logf(s);
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j;
      const float d = ld(c, env, 0, idx) - m;
      store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), log ? d - log_s : expf(d) / s);
    }
  }
}

// cumsum (kProd: cumprod) over the last dim: a warp per row walks it 32 elements at a time, an
// inclusive warp scan of each chunk combined with the carry of the chunks before — in float32
// for floats (torch's accumulation type for float, half and bfloat16) and 64-bit integers for
// integer results (a product wraps as eager's does).
template <typename T, bool kProd>
__device__ __forceinline__ void cumsum_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long len = c.out_shape[c.ndim - 1];
  const ViewC& x = c.in[0];
  void* out = env.buffers[c.out_buffer];
  const auto fold = [](T a, T b) -> T {
    if constexpr (!kProd) return a + b;
    else if constexpr (std::is_integral_v<T>)  // wraps (well defined unsigned), as eager's product
      return static_cast<T>(static_cast<unsigned long long>(a) * static_cast<unsigned long long>(b));
    else return a * b;
  };
  MPK_FOR_ROWS(c, r, idx) {
    T carry = kProd ? 1 : 0;
    for (long long j0 = 0; j0 < len; j0 += 32) {
      const long long j = j0 + lane;
      T v = kProd ? 1 : 0;
      if (j < len) {
        idx[c.ndim - 1] = j;
        v = load_as<T>(env.buffers[x.buffer], x.dtype, view_index(x, idx, c.ndim));
      }
      for (int o = 1; o < 32; o <<= 1) {
        const T u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v = fold(u, v);
      }
      v = fold(carry, v);
      if (j < len) store_as(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), v);
      carry = __shfl_sync(0xffffffffu, v, 31);
    }
  }
}

// iparam[0]: cumprod
__device__ void task_cumsum(const OpC& c, const Rect& r, const TaskEnv& env) {
  const bool prod = c.iparam[0] != 0;
  if (is_int(c.out_dtype)) {
    if (prod) cumsum_rows<long long, true>(c, r, env);
    else cumsum_rows<long long, false>(c, r, env);
  } else {
    if (prod) cumsum_rows<float, true>(c, r, env);
    else cumsum_rows<float, false>(c, r, env);
  }
}

// (m, s) ⊕ (om, os) for softmax's running (max, Σ e^(x − max)); an empty side has m = −inf,
// s = 0; a NaN sum stays (torch: a NaN anywhere in the row makes the whole row NaN).
__device__ __forceinline__ void softmax_fold(float& m, float& s, float om, float os) {
  if (os != os) {
    s = os;
    return;
  }
  const float mn = fmaxf(m, om);
  if (mn == -INFINITY) return;
  s = s * expf(m - mn) + os * expf(om - mn);
  m = mn;
}

// softmax over long rows of T into O: one pass for each thread's (max, Σ e^(x − max)) over its
// words (a NaN makes the sum, and so the row, NaN as in torch), combined over the warps in warp
// order by every thread, then a second pass (the row again, from L2) writes e^(x − max) / Σ.
template <typename T, typename O>
__device__ __noinline__ void softmax_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T));
  const ViewC& x = c.in[0];
  const long long len = c.out_shape[c.ndim - 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* red = scratch();
  const long long nrows = rect_numel(r, c.ndim - 1);
  for (long long row = 0; row < nrows; ++row) {
    long long idx[kMaxDims];
    const T* p = static_cast<const T*>(env.buffers[x.buffer]) + row_start(c, r, c.ndim - 1, row, idx);
    O* out = static_cast<O*>(env.buffers[c.out_buffer]) + ravel(idx, c.out_shape, c.ndim);
    float m = -INFINITY, s = 0.f;
    for_row_words<T>(p, len, [&](const float (&e)[kE], long long) {
      float wm = e[0];
#pragma unroll
      for (int i = 1; i < kE; ++i) wm = max_nan(wm, e[i]);
      if (wm == -INFINITY) return;  // (−inf, 0): nothing to add
      // a word under the running max adds its terms to s as they are; only a new max (rare
      // after the first words) rescales s, so most words cost no exponential on s's chain
      // (a NaN takes the second branch: s and m become NaN and stay so)
      if (!(wm <= m)) {
        s *= expf(m - wm);
        m = wm;
      }
#pragma unroll
      for (int i = 0; i < kE; ++i) s += expf(e[i] - m);
    });
    for (int o = 16; o > 0; o >>= 1) {
      const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
      softmax_fold(m, s, om, os);
    }
    if (lane == 0) {
      red[2 * warp] = m;
      red[2 * warp + 1] = s;
    }
    __syncthreads();
    m = red[0];
    s = red[1];
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) softmax_fold(m, s, red[2 * w], red[2 * w + 1]);
    const float inv = 1.f / s, log_s = logf(s);  // one division per row, not per element
    const bool log = c.iparam[0];
    for_row_words<T>(p, len, [&](const float (&e)[kE], long long j) {
      float y[kE];
#pragma unroll
      for (int i = 0; i < kE; ++i) y[i] = log ? (e[i] - m) - log_s : expf(e[i] - m) * inv;
      store_vec<kE>(out + j, y);
    });
    __syncthreads();  // red is rewritten by the next row
  }
}

// layer_norm: fparam[0] eps; iparam[0] has weight, iparam[1] has bias.
__device__ void task_layer_norm(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long len = c.out_shape[c.ndim - 1];
  void* out = env.buffers[c.out_buffer];
  const int wi = c.iparam[0] ? 1 : -1, bi = c.iparam[1] ? (c.iparam[0] ? 2 : 1) : -1;
  MPK_FOR_ROWS(c, r, idx) {
    float s = 0.f;
    for (long long j = lane; j < len; j += 32) { idx[c.ndim - 1] = j; s += ld(c, env, 0, idx); }
    const float mean = warp_sum(s) / len;
    float q = 0.f;
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j;
      const float d = ld(c, env, 0, idx) - mean;
      q += d * d;
    }
    const float rstd = rsqrtf(warp_sum(q) / len + c.fparam[0]);
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j;
      float y = (ld(c, env, 0, idx) - mean) * rstd;
      if (wi >= 0) y *= ld(c, env, wi, idx);
      if (bi >= 0) y += ld(c, env, bi, idx);
      store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), y);
    }
  }
}

// rms_norm: fparam[0] eps; iparam[0] has weight; iparam[1] dtype the normalised value is cast to.
// Variant 1 (codegen picks it): bf16 rows with unit stride, 16-byte aligned, a bf16 weight
// and a bf16 output — decode's case, where one row (the batch-1 hidden state) is a task. The
// whole CTA shares a row: 16-byte loads kept in registers, one block reduction, one pass out.
// 8 bf16 elements of a row normalised as HF does: round(x·rstd) to bf16, times the weight,
// round again.
__device__ __forceinline__ uint4 rms_scale8(uint4 x, uint4 w, float rstd) {
  return zip_bf16x8(x, w, [rstd](float v, float g) { return round_to(kBF16, v * rstd) * g; });
}

constexpr int kNormVecs = 4;  // 8-element vectors per thread held in registers: rows ≤ 8192 at 256 threads

// The bf16 RMSNorm's order of summing a row's squares, which the linear's RMSNorm prologue
// (linalg.cuh, in a loop) follows so that its rows equal the rms_norm task's bit for bit:
// thread t adds the squares of words t + blockDim·i in i order (``word(i)``: that word, zero
// past the row), the warp reduces, and warp_rstd adds the warps' sums in warp order.
template <typename Word>
__device__ __forceinline__ float warp_sum_squares(Word word) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) ss += sum_squares8(word(i));
  return warp_sum(ss);
}

// sums: the row's per-warp sums (warp_sum_squares), ``stride`` floats apart.
__device__ __forceinline__ float warp_rstd(const float* sums, int stride, int len, float eps) {
  float total = 0.f;
  for (int v = 0; v < static_cast<int>(blockDim.x >> 5); ++v) total += sums[v * stride];
  return rsqrtf(total / len + eps);
}

__device__ void rms_norm_rows_bf16(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC &x = c.in[0], &w = c.in[1];
  const int len = static_cast<int>(c.out_shape[c.ndim - 1]), vecs = len / 8;
  const long long row_stride = x.ndim > 1 ? x.stride[x.ndim - 2] : 0;
  float* red = scratch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const auto* wv = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(env.buffers[w.buffer]) + w.offset);
  for (long long row = r.lo[0]; row < r.hi[0]; ++row) {
    const auto* xv = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(env.buffers[x.buffer]) +
                                                    x.offset + row * row_stride);
    uint4 v[kNormVecs];
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      v[i] = j < vecs ? xv[j] : make_uint4(0, 0, 0, 0);
    }
    const float ss = warp_sum_squares([&v](int i) { return v[i]; });
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    const float rstd = warp_rstd(red, 1, len, c.fparam[0]);
    auto* ov = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(env.buffers[c.out_buffer]) + row * len);
#pragma unroll
    for (int i = 0; i < kNormVecs; ++i) {
      const int j = threadIdx.x + i * blockDim.x;
      if (j >= vecs) break;
      ov[j] = rms_scale8(v[i], wv[j], rstd);
    }
    __syncthreads();  // red is rewritten by the next row
  }
}

__device__ void task_rms_norm(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (c.variant == 1) {
    rms_norm_rows_bf16(c, r, env);
    return;
  }
  const long long len = c.out_shape[c.ndim - 1];
  void* out = env.buffers[c.out_buffer];
  MPK_FOR_ROWS(c, r, idx) {
    float q = 0.f;
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j;
      const float v = ld(c, env, 0, idx);
      q += v * v;
    }
    const float rstd = rsqrtf(warp_sum(q) / len + c.fparam[0]);
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j;
      float y = round_to(static_cast<int>(c.iparam[1]), ld(c, env, 0, idx) * rstd);
      if (c.iparam[0]) y *= ld(c, env, 1, idx);
      store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), y);
    }
  }
}

// rope (rotate-half): out = x·cos + cat(-x[half:], x[:half])·sin; inputs x, cos, sin.
__device__ void task_rope(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long len = c.out_shape[c.ndim - 1], half = len / 2;
  void* out = env.buffers[c.out_buffer];
  MPK_FOR_ROWS(c, r, idx) {
    for (long long j = lane; j < len; j += 32) {
      idx[c.ndim - 1] = j < half ? j + half : j - half;
      const float partner = ld(c, env, 0, idx);
      idx[c.ndim - 1] = j;
      const float y = ld(c, env, 0, idx) * ld(c, env, 1, idx) + (j < half ? -partner : partner) * ld(c, env, 2, idx);
      store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), y);
    }
  }
}

}  // namespace mpk

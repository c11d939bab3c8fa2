// Task family: sorting rows. ``sort``: the indices of the first k entries (k = the output's last
// dim) of each row in a stable sort — torch.sort, argsort and topk; the values are a gather of
// them. The whole CTA takes one row at a time: a row of at most kSortMax entries is sorted whole
// in shared memory; of a longer one (a vocabulary of logits) a radix select narrows the entries
// down to those that can be among the first k (select_candidates), which are then sorted.
#pragma once
#include "common.cuh"

namespace mpk {

constexpr int kSortMax = 2048;  // mpk.ops.rows.SORT_MAX

// Keys of 64 bits for 8-byte entries (float64, int64), else of 32.
template <typename T>
using SortKey = std::conditional_t<sizeof(T) == 8, unsigned long long, unsigned>;

// An entry as an unsigned key whose order is the output's, larger first: floats by their bits
// with the negative ones reversed (float32 holds the 16-bit float types exactly), -0 as 0 and
// every NaN as the largest value (torch's order); integers with their sign bit flipped.
// Ascending order complements the key.
template <typename T>
__device__ __forceinline__ SortKey<T> sort_key(T v, bool descending) {
  using K = SortKey<T>;
  constexpr K kTop = K(1) << (8 * sizeof(K) - 1);
  K k;
  if constexpr (std::is_integral_v<T>) {
    k = static_cast<K>(static_cast<long long>(v)) ^ kTop;
  } else {
    K b;
    if constexpr (sizeof(T) == 8) {
      b = v != v ? ~K(0) : static_cast<K>(__double_as_longlong(v == 0.0 ? 0.0 : v));
    } else {
      const float f = to_f(v);
      b = f != f ? ~K(0) : static_cast<K>(__float_as_uint(f == 0.f ? 0.f : f));
    }
    k = b == ~K(0) ? b : (b & kTop) ? ~b : b | kTop;
  }
  return descending ? k : ~k;
}

template <typename K>
struct SortSmem {
  K key[kSortMax];
  unsigned idx[kSortMax];
  unsigned hist[256];
  unsigned warp_count[2][32];  // collection rounds alternate halves: one barrier a round
  unsigned digit, above, in_bin, count;  // select_candidates' pass results, collection slots
};

// Whether entry a comes before entry b: the larger key, then the smaller index (stable).
template <typename K>
__device__ __forceinline__ bool sorts_before(const SortSmem<K>& s, int a, int b) {
  return s.key[a] > s.key[b] || (s.key[a] == s.key[b] && s.idx[a] < s.idx[b]);
}

// Bitonic sort of s's first m entries (m a power of two), every thread of the CTA.
template <typename K>
__device__ void bitonic_sort(SortSmem<K>& s, int m) {
  for (int size = 2; size <= m; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int t = threadIdx.x; t < m / 2; t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        // blocks with bit `size` clear end in output order, the others reversed
        if (sorts_before(s, hi, lo) == ((lo & size) == 0)) {
          const K k = s.key[lo];
          const unsigned i = s.idx[lo];
          s.key[lo] = s.key[hi];
          s.idx[lo] = s.idx[hi];
          s.key[hi] = k;
          s.idx[hi] = i;
        }
      }
    }
  __syncthreads();
}

constexpr int kSortUnroll = 16;  // entries a thread loads before it keys the first: loads in flight

// fn(j, key, valid) for every entry j of the row p[j · step], kSortUnroll loads in flight per
// thread (plain typed loads, keyed after all are issued); every lane of every warp makes the
// same calls (valid false past the end), so fn may use warp votes.
template <typename T, typename Fn>
__device__ __forceinline__ void for_row_keys(const T* p, long long step, long long n, bool descending, Fn fn) {
  for (long long j0 = 0; j0 < n; j0 += kSortUnroll * static_cast<long long>(blockDim.x)) {
    T v[kSortUnroll];
#pragma unroll
    for (int u = 0; u < kSortUnroll; ++u) {
      const long long j = j0 + u * blockDim.x + threadIdx.x;
      v[u] = j < n ? p[j * step] : T();
    }
#pragma unroll
    for (int u = 0; u < kSortUnroll; ++u) {
      const long long j = j0 + u * blockDim.x + threadIdx.x;
      fn(j, sort_key(v[u], descending), j < n);
    }
  }
}

// The entries of a row longer than kSortMax that can be among its first k, into s: m returned.
// Radix select, 8 bits a pass from the top: each pass counts the candidates' next digit (a
// warp's equal digits in one shared atomic) and keeps the digit where the k-th entry lies. As
// soon as the entries above that digit and those in it fit in s — one or two passes for real
// logits — one more pass takes all of them (the sort puts them in order; ties included). Only
// when more than kSortMax entries equal the k-th key are the first of them taken in index order.
template <typename T, typename K = SortKey<T>>
__device__ unsigned select_candidates(SortSmem<K>& s, const T* p, long long step, long long n, unsigned k,
                                      bool descending) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  K prefix = 0, mask = 0;
  unsigned greater = 0, in_bin = 0;  // entries above the prefix (all taken), entries on it
  for (int shift = 8 * static_cast<int>(sizeof(K)) - 8; shift >= 0; shift -= 8) {
    for (int t = threadIdx.x; t < 256; t += blockDim.x) s.hist[t] = 0;
    __syncthreads();
    for_row_keys(p, step, n, descending, [&](long long, K key, bool valid) {
      const bool cand = valid && (key & mask) == prefix;
      const unsigned d = cand ? static_cast<unsigned>(key >> shift) & 255 : 256;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (cand && lane == __ffs(peers) - 1) atomicAdd(&s.hist[d], __popc(peers));
    });
    __syncthreads();
    if (threadIdx.x < 32) {  // lane l holds digits 255 − 8l … 248 − 8l: lanes in order walk them downwards
      const unsigned need = k - greater;
      unsigned c[8], sum = 0;
      for (int i = 0; i < 8; ++i) sum += c[i] = s.hist[255 - 8 * lane - i];
      unsigned incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      unsigned above = incl - sum;  // candidates with a larger digit
      if (above < need && need <= incl)
        for (int i = 0; i < 8; ++i) {
          if (above + c[i] >= need) {
            s.digit = 255 - 8 * lane - i;
            s.above = above;
            s.in_bin = c[i];
            break;
          }
          above += c[i];
        }
    }
    __syncthreads();
    prefix |= static_cast<K>(s.digit) << shift;
    mask |= static_cast<K>(255) << shift;
    greater += s.above;
    in_bin = s.in_bin;
    if (greater + in_bin <= kSortMax) {  // (key & mask) >= prefix: above the prefix or on it
      if (threadIdx.x == 0) s.count = 0;
      __syncthreads();
      for_row_keys(p, step, n, descending, [&](long long j, K key, bool valid) {
        if (valid && (key & mask) >= prefix) {
          const unsigned at = atomicAdd(&s.count, 1u);
          s.key[at] = key;
          s.idx[at] = static_cast<unsigned>(j);
        }
      });
      return greater + in_bin;
    }
  }
  // more than kSortMax - greater entries equal the k-th key (prefix): those above it, then the
  // first k - greater of the equal ones in index order
  const unsigned need = k - greater;
  unsigned taken = 0, gt = 0;
  for (long long j0 = 0, round = 0; j0 < n; j0 += blockDim.x, ++round) {
    const long long j = j0 + threadIdx.x;
    const K key = j < n ? sort_key(p[j * step], descending) : K(0);
    const bool is_gt = j < n && key > prefix, is_eq = j < n && key == prefix;
    const unsigned gts = __ballot_sync(0xffffffffu, is_gt), eqs = __ballot_sync(0xffffffffu, is_eq);
    unsigned* counts = s.warp_count[round & 1];
    if (lane == 0) counts[warp] = __popc(gts) | (__popc(eqs) << 16);
    __syncthreads();
    unsigned gt_before = gt, eq_before = taken;
    for (int w = 0; w < warps; ++w) {
      const unsigned cw = counts[w];
      if (w < warp) gt_before += cw & 0xffff, eq_before += cw >> 16;
      gt += cw & 0xffff;
      taken += cw >> 16;
    }
    const unsigned lower = (1u << lane) - 1;
    if (is_gt) {
      const unsigned at = gt_before + __popc(gts & lower);
      s.key[at] = key;
      s.idx[at] = static_cast<unsigned>(j);
    } else if (is_eq) {
      const unsigned rank = eq_before + __popc(eqs & lower);
      if (rank < need) {
        s.key[greater + rank] = key;
        s.idx[greater + rank] = static_cast<unsigned>(j);
      }
    }
  }
  return k;
}

// iparam[0] = 1: descending. T: the input's element type (codegen: _sort_task).
template <typename T>
__device__ __noinline__ void sort_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  using K = SortKey<T>;
  static_assert(sizeof(SortSmem<K>) <= kScratchFloats * sizeof(float), "sort rows exceed the task scratch");
  SortSmem<K>& s = *reinterpret_cast<SortSmem<K>*>(scratch());
  const ViewC& x = c.in[0];
  const int last = c.ndim - 1;
  const long long n = x.shape[last], step = x.stride[last];
  const unsigned k = static_cast<unsigned>(c.out_shape[last]);
  const bool descending = c.iparam[0];
  const long long nrows = rect_numel(r, last);
  for (long long row = 0; row < nrows; ++row) {
    long long idx[kMaxDims];
    rect_unravel(r, last, row, idx);
    idx[last] = 0;
    const T* p = static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, x.ndim);
    unsigned m;  // entries to sort
    if (n <= kSortMax) {
      m = static_cast<unsigned>(n);
      for (int j = threadIdx.x; j < n; j += blockDim.x) {
        s.key[j] = sort_key(p[j * step], descending);
        s.idx[j] = j;
      }
    } else {
      m = select_candidates(s, p, step, n, k, descending);
    }
    unsigned m2 = 1;
    while (m2 < m) m2 <<= 1;
    for (unsigned j = m + threadIdx.x; j < m2; j += blockDim.x) {  // padding sorts last
      s.key[j] = 0;
      s.idx[j] = ~0u;
    }
    bitonic_sort(s, static_cast<int>(m2));
    void* out = env.buffers[c.out_buffer];
    for (unsigned j = threadIdx.x; j < k; j += blockDim.x) {
      idx[last] = j;
      store_i(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), s.idx[j]);
    }
    __syncthreads();  // s is rewritten by the next row
  }
}

}  // namespace mpk

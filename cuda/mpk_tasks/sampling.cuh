// Task family: sampling (mpk.ops.sampling, whose docstring is the algorithm's full statement).
// One token per row of logits [B, V] under the row's temperature, top-k, top-p, min-p, seed and
// counter — mpk.engine.sampling.sample's semantics — as a radix select of the filters' one
// threshold on the logits' order-preserving keys (8-bit digits: 2 levels for bf16/f16, 4 for
// float32), every level segment-parallel:
//
//  * sample_partial, a (row, segment) tile: the segment (SEGMENT logits, held in registers: one
//    read) gives its max and first index, then its first-digit histogram: counts, and masses in
//    fixed point round(2^(x·scale − E_s)·2^40) relative to the segment's power of two
//    E_s = ⌈segmax·scale⌉ (the row max is not known yet). Integer sums are exact and the same in
//    any order; a row adds a segment's sums in its own unit by a right shift of E_row − E_s, in
//    segment order: the same seed and counter give the same token bit for bit;
//  * sample_digit (level L), a (row, segment) tile: every tile merges the row's histograms of
//    levels < L and selects the same digits (sample_plan), then histograms digit L of its
//    segment's tokens under that prefix;
//  * sample, a row a tile: the plan over all levels is the exact threshold; each segment's kept
//    mass comes from the histograms; the segment holding ⌊u·W⌋ (id order) is read again and
//    scanned by the whole CTA for the token (inverse CDF in id order).
//
// Level-1 digits are hot (the exponent bits: nearly all logits share a few), so sample_partial
// adds a warp's equal digits once (match, then two 32-bit reductions); later levels' candidates
// lie in one bin of 256 keys, spread, and add with plain shared atomics. Min-p's threshold key is
// found by bisection over the key space (no data). Work per row (bf16, V = 151,936, S = 10
// segments): one read of the row, a key compare per logit and one read of a segment; per tile
// the merge of S · 4 KiB a level.
#pragma once
#include "common.cuh"
#include "rows.cuh"

namespace mpk {

constexpr float kMassOne = 1099511627776.f;  // 2^40: the fixed-point mass of 2^E_s
constexpr int kSampleBins = 256;             // a digit's values (mpk.ops.sampling.BINS)
constexpr int kSampleMaxSegments = 256;      // mpk.ops.sampling.MAX_SEGMENTS
constexpr int kSampleSegWords = 16;          // 16-byte words a thread holds of a segment (256 threads)

struct SamplePlan {
  float max, scale;
  long long token;                 // the row's argmax (torch.argmax's order)
  unsigned prefix;                 // the selected digits in place
  unsigned digit[4];               // each level's selected digit
  bool greedy;
};

struct SampleSmem {
  unsigned long long mass[kSampleBins];   // a level's merged masses (row units), or a tile's own histogram
  unsigned cnt[kSampleBins];
  float ref[kSampleMaxSegments];          // each segment's E_s
  unsigned char shift[kSampleMaxSegments];  // E_row − E_s (at most 63)
  unsigned long long kept[kSampleMaxSegments];  // each segment's kept mass (its units)
  unsigned long long red_u[32];
  float red_f[32];
  long long red_i[32];
  SamplePlan plan;
  unsigned k_digit, p_digit, k_above;
  unsigned long long p_above;
  long long pick_seg;
  unsigned long long pick_rest;
};

// A logit's bits as an unsigned key in the value order (kBits wide): negative values reversed,
// -0 as 0, every NaN the largest (torch's order).
template <typename T>
__device__ __forceinline__ unsigned sample_key(T v) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr unsigned kTop = 1u << (kBits - 1), kAll = kBits == 32 ? ~0u : (1u << kBits) - 1;
  unsigned b;
  bool nan;
  if constexpr (std::is_same_v<T, float>) {
    b = __float_as_uint(v);
    nan = v != v;
  } else if constexpr (std::is_same_v<T, __half>) {
    b = __half_as_ushort(v);
    nan = __hisnan(v);
  } else {
    b = __bfloat16_as_ushort(v);
    nan = __hisnan(v);
  }
  if (nan) return kAll;
  if (b == kTop) b = 0;
  return (b & kTop) ? (~b & kAll) : (b | kTop);
}

// The float32 value of a key of T (sample_key's inverse).
template <typename T>
__device__ __forceinline__ float key_value(unsigned k) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  constexpr unsigned kTop = 1u << (kBits - 1), kAll = kBits == 32 ? ~0u : (1u << kBits) - 1;
  const unsigned b = (k & kTop) ? (k ^ kTop) : (~k & kAll);
  if constexpr (std::is_same_v<T, float>) return __uint_as_float(b);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  else return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
}

// A segment's power of two E_s = ⌈segmax·scale⌉ (0 where not finite). mpk.ops.sampling.seg_ref.
__device__ __forceinline__ float seg_ref(float segmax, float scale) {
  const float a = segmax * scale;
  return isfinite(a) ? ceilf(a) : 0.f;
}

// A token's fixed-point mass relative to its segment's 2^E_s: one rounding of x·scale − E_s
// (fmaf), exp2f, 2^40 units. One function for every op, so histograms and the final scan see the
// same integers. mpk.ops.sampling.masses.
__device__ __forceinline__ unsigned long long sample_mass(float x, float scale, float ref) {
  return __float2ull_rn(exp2f(fmaf(x, scale, -ref)) * kMassOne);
}

// One token's digit, count and mass into hist (cand: it counts): a warp's equal digits summed with
// two 32-bit reductions (26 low bits and the rest: 32 of each fit, m < 2^41) and added once.
__device__ __forceinline__ void hist_add_warp(SampleSmem& s, bool cand, unsigned d, unsigned long long m) {
  if (!__any_sync(0xffffffffu, cand)) return;
  const unsigned peers = __match_any_sync(0xffffffffu, cand ? d : kSampleBins);
  const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(m & 0x3ffffffu));
  const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(m >> 26));
  if (cand && (threadIdx.x & 31) == __ffs(peers) - 1) {
    atomicAdd(&s.cnt[d], __popc(peers));
    atomicAdd(&s.mass[d], (static_cast<unsigned long long>(hi) << 26) + lo);
  }
}

// Warp 0: the digit, walking hist from 255 down, where the running total first reaches need,
// and the total of the digits above it; digit 0 where the total falls short (row-unit masses
// round down per segment). mpk.ops.sampling._select.
template <typename C>
__device__ __forceinline__ void select_digit(const C* hist, long long need, unsigned* digit, C* above_out) {
  const int lane = threadIdx.x & 31;  // lane l holds digits 255 − 8l … 248 − 8l
  C c[8], sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += c[i] = hist[255 - 8 * lane - i];
  C incl = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const C v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  C above = incl - sum;
  const long long lo = static_cast<long long>(above), hi = static_cast<long long>(incl);
  if (lo < need && need <= hi) {
    for (int i = 0; i < 8; ++i) {
      if (static_cast<long long>(above + c[i]) >= need) {
        *digit = 255 - 8 * lane - i;
        *above_out = above;
        break;
      }
      above += c[i];
    }
  } else if (lane == 31 && hi < need) {
    *digit = 0;
    *above_out = incl - c[7];
  }
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// SplitMix64's finaliser (mpk.engine.sampling.mix64).
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Field f of (b, s) in a [B, S, F] int64 histogram input.
__device__ __forceinline__ const long long* hist_at(const OpC& c, const TaskEnv& env, int input, long long b,
                                                    long long s) {
  const ViewC& v = c.in[input];
  long long idx[3] = {b, s, 0};
  return static_cast<const long long*>(env.buffers[v.buffer]) + view_index(v, idx, 3);
}

__device__ __forceinline__ float param_f(const OpC& c, const TaskEnv& env, int input, long long b) {
  return load_f(env.buffers[c.in[input].buffer], c.in[input].dtype, view_index(c.in[input], &b, 1));
}

__device__ __forceinline__ long long param_i(const OpC& c, const TaskEnv& env, int input, long long b) {
  return load_i(env.buffers[c.in[input].buffer], c.in[input].dtype, view_index(c.in[input], &b, 1));
}

// The segment [first, first + len) of the row at p into registers, word w·blockDim.x + tid in
// raw[w] (len a multiple of kE; past the end zero words, valid() false).
template <typename T>
__device__ __forceinline__ void load_segment(const T* p, long long len, uint4 (&raw)[kSampleSegWords]) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T));
  const uint4* pv = reinterpret_cast<const uint4*>(p);
  const long long words = len / kE;
#pragma unroll
  for (int u = 0; u < kSampleSegWords; ++u) {
    const long long w = u * blockDim.x + threadIdx.x;
    raw[u] = w < words ? pv[w] : make_uint4(0, 0, 0, 0);
  }
}

// Where level l's histogram of (b, j) starts: the partials at input part_in (level 1), else the
// last sample_digit op's output at part_in + 1, which holds levels 2, 3, … in order.
__device__ __forceinline__ const long long* level_at(const OpC& c, const TaskEnv& env, int part_in, int level,
                                                     long long b, long long j) {
  return level == 1 ? hist_at(c, env, part_in, b, j) + 2
                    : hist_at(c, env, part_in + 1, b, j) + (level - 2) * 2 * kSampleBins;
}

// Every thread: the row's plan after `levels` histogram levels (level_at), into s.plan; s.ref / s.shift hold the segments' E_s and shifts.
// Inputs 1…4: temperature, top_k, top_p, min_p. mpk.ops.sampling.plan, the same integers.
template <typename T>
__device__ void sample_plan(const OpC& c, const TaskEnv& env, long long b, int part_in, int levels, long long V,
                            SampleSmem& s) {
  constexpr int kBits = 8 * static_cast<int>(sizeof(T));
  const long long S = c.in[part_in].shape[1];
  const float temperature = param_f(c, env, 1, b);
  const bool greedy = !(temperature > 0.f);
  const float scale = 1.4426950408889634f / (greedy ? 1.f : temperature);
  __syncthreads();  // s is free (a previous row's users are done)
  if (threadIdx.x == 0) {
    float acc = -INFINITY, eref = -INFINITY;
    long long arg = 0;
    for (long long j = 0; j < S; ++j) {
      const long long* h = hist_at(c, env, part_in, b, j);
      const float m = __int_as_float(static_cast<int>(h[0]));
      if (j == 0 || argmax_before(m, h[1], acc, arg)) {
        acc = m;
        arg = h[1];
      }
      s.ref[j] = seg_ref(m, scale);
      eref = fmaxf(eref, s.ref[j]);
    }
    for (long long j = 0; j < S; ++j) s.shift[j] = static_cast<unsigned char>(fminf(63.f, eref - s.ref[j]));
    s.plan = SamplePlan{acc, scale, arg, 0u, {0u, 0u, 0u, 0u}, greedy};
  }
  __syncthreads();
  if (greedy) return;
  const float mx = s.plan.max, top_p = param_f(c, env, 3, b), min_p = param_f(c, env, 4, b);
  const long long top_k = param_i(c, env, 2, b);
  bool act_k = top_k > 0 && top_k < V, act_p = top_p < 1.f, act_m = min_p > 0.f;
  unsigned m_key = 0;  // the smallest key whose value passes min-p (bisection; max's key passes)
  if (act_m) {
    unsigned lo = 0, hi = sample_key(static_cast<T>(mx));
    while (lo < hi) {
      const unsigned mid = lo + (hi - lo) / 2;
      if (exp2f((key_value<T>(mid) - mx) * scale) >= min_p) hi = mid;
      else lo = mid + 1;
    }
    m_key = hi;
  }
  long long k_above = 0;
  unsigned long long p_above = 0, p_target = 0;
  unsigned prefix = 0;
  for (int level = 1; level <= levels; ++level) {
    for (int t = threadIdx.x; t < kSampleBins; t += blockDim.x) {
      unsigned long long cnt = 0, mass = 0;
      for (long long j = 0; j < S; ++j) {
        const long long* h = level_at(c, env, part_in, level, b, j);
        cnt += h[t];
        mass += static_cast<unsigned long long>(h[kSampleBins + t]) >> s.shift[j];
      }
      s.cnt[t] = static_cast<unsigned>(cnt);
      s.mass[t] = mass;
    }
    __syncthreads();
    if (level == 1) {  // Z, the row's mass, in bin order; p's target ⌈p·Z⌉
      unsigned long long z = 0;
      for (int t = 0; t < kSampleBins; ++t) z += s.mass[t];
      p_target = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(z)));
      p_target = p_target < 1 ? 1 : p_target;
    }
    if (threadIdx.x < 32) {
      if (act_k) select_digit<unsigned>(s.cnt, top_k - k_above, &s.k_digit, &s.k_above);
      if (act_p) select_digit<unsigned long long>(s.mass, static_cast<long long>(p_target - p_above), &s.p_digit,
                                                  &s.p_above);
    }
    __syncthreads();
    const int sh = kBits - 8 * level;
    const unsigned dk = act_k ? s.k_digit : 0u, dp = act_p ? s.p_digit : 0u, dm = act_m ? (m_key >> sh) & 255u : 0u;
    const unsigned d = max(max(dk, dp), dm);
    act_k = act_k && dk == d;
    act_p = act_p && dp == d;
    act_m = act_m && dm == d;
    if (act_k) k_above += s.k_above;
    if (act_p) p_above += s.p_above;
    prefix |= d << sh;
    __syncthreads();  // s.cnt / s.mass / the digits are rewritten by the next level
    if (threadIdx.x == 0) {
      s.plan.digit[level - 1] = d;
      s.plan.prefix = prefix;
    }
  }
  __syncthreads();
}

// Inputs: logits [B, V] (T, contiguous rows of whole 16-byte words: codegen checks), temperature
// [B]; output partials [B, S, 2 + 2·256] int64: segment s's max (float32 bits), its first index
// (torch.argmax's order), and (a sampled row) its first-digit counts and masses. iparam[0]: the
// segment length (mpk.ops.sampling.SEGMENT: at most kSampleSegWords words a thread).
template <typename T>
__device__ __noinline__ void sample_partial(const OpC& c, const Rect& r, const TaskEnv& env) {
  static_assert(sizeof(SampleSmem) <= kScratchFloats * sizeof(float), "sampling state exceeds the task scratch");
  constexpr int kE = 16 / static_cast<int>(sizeof(T)), kBits = 8 * static_cast<int>(sizeof(T));
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(scratch());
  const ViewC& x = c.in[0];
  const long long V = x.shape[1], seg = c.iparam[0];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    const float temperature = param_f(c, env, 1, b);
    const bool greedy = !(temperature > 0.f);
    const float scale = 1.4426950408889634f / (greedy ? 1.f : temperature);
    for (long long sg = r.lo[1]; sg < r.hi[1]; ++sg) {
      long long idx[kMaxDims] = {b, sg * seg};
      const long long first = sg * seg, len = (V < first + seg ? V : first + seg) - first, words = len / kE;
      uint4 raw[kSampleSegWords];
      load_segment(static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, 2), len, raw);
      float acc = -INFINITY;
      long long arg = first;
#pragma unroll
      for (int u = 0; u < kSampleSegWords; ++u) {
        const long long w = u * blockDim.x + threadIdx.x;
        if (w < words) {
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int i = 0; i < kE; ++i) argmax_add(acc, arg, to_f(v[i]), first + w * kE + i);
        }
      }
      warp_argmax(acc, arg);
      for (int t = threadIdx.x; t < kSampleBins; t += blockDim.x) {
        s.cnt[t] = 0;
        s.mass[t] = 0;
      }
      if (lane == 0) {
        s.red_f[warp] = acc;
        s.red_i[warp] = arg;
      }
      __syncthreads();
      for (int i = 0; i < warps; ++i)  // every thread: the segment's max (its E_s)
        if (argmax_before(s.red_f[i], s.red_i[i], acc, arg) || i == 0) {
          acc = s.red_f[i];
          arg = s.red_i[i];
        }
      if (!greedy) {
        const float ref = seg_ref(acc, scale);
#pragma unroll
        for (int u = 0; u < kSampleSegWords; ++u) {
          const long long w0 = u * blockDim.x + (threadIdx.x & ~31);
          if (w0 >= words) break;  // the warp's words are all past the end
          const bool valid = w0 + lane < words;
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int i = 0; i < kE; ++i)
            hist_add_warp(s, valid, sample_key(v[i]) >> (kBits - 8), valid ? sample_mass(to_f(v[i]), scale, ref) : 0);
        }
      }
      __syncthreads();
      long long* out = static_cast<long long*>(env.buffers[c.out_buffer]) + (b * c.out_shape[1] + sg) * c.out_shape[2];
      if (threadIdx.x == 0) {
        out[0] = static_cast<long long>(__float_as_int(acc));
        out[1] = arg;
      }
      for (int t = threadIdx.x; t < kSampleBins; t += blockDim.x) {
        out[2 + t] = s.cnt[t];
        out[2 + kSampleBins + t] = static_cast<long long>(s.mass[t]);
      }
      __syncthreads();  // s is rewritten by the next segment
    }
  }
}

// Inputs: logits [B, V], temperature, top_k, top_p, min_p [B], partials [B, S, 2 + 2·256], then
// (L > 2) the previous sample_digit op's histograms of levels 2 … L − 1 [B, S, (L − 2)·2·256];
// output [B, S, (L − 1)·2·256] int64: those levels again (so the last op holds every level: the
// sample op's inputs stay few), then digit L's counts and masses of each segment's tokens under
// the prefix the plan selects (zeros: a greedy row). iparam[0]: the segment length; iparam[1]: L.
template <typename T>
__device__ __noinline__ void sample_digit(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T)), kBits = 8 * static_cast<int>(sizeof(T));
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(scratch());
  const ViewC& x = c.in[0];
  const long long V = x.shape[1], seg = c.iparam[0];
  const int level = static_cast<int>(c.iparam[1]), hi = kBits - 8 * (level - 1);
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    sample_plan<T>(c, env, b, 5, level - 1, V, s);
    const SamplePlan pl = s.plan;
    for (long long sg = r.lo[1]; sg < r.hi[1]; ++sg) {
      for (int t = threadIdx.x; t < kSampleBins; t += blockDim.x) {
        s.cnt[t] = 0;
        s.mass[t] = 0;
      }
      __syncthreads();
      if (!pl.greedy) {
        long long idx[kMaxDims] = {b, sg * seg};
        const long long first = sg * seg, len = (V < first + seg ? V : first + seg) - first, words = len / kE;
        uint4 raw[kSampleSegWords];
        load_segment(static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, 2), len, raw);
        const float ref = s.ref[sg];
#pragma unroll
        for (int u = 0; u < kSampleSegWords; ++u) {
          if (u * blockDim.x + threadIdx.x >= words) break;
          const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int i = 0; i < kE; ++i) {
            const unsigned key = sample_key(v[i]);
            if ((key >> hi) == (pl.prefix >> hi)) {  // a candidate: its digit is spread, so plain atomics
              const unsigned d = (key >> (hi - 8)) & 255u;
              atomicAdd(&s.cnt[d], 1u);
              atomicAdd(&s.mass[d], sample_mass(to_f(v[i]), pl.scale, ref));
            }
          }
        }
      }
      __syncthreads();
      long long* out = static_cast<long long*>(env.buffers[c.out_buffer]) + (b * c.out_shape[1] + sg) * c.out_shape[2];
      const int copied = (level - 2) * 2 * kSampleBins;
      if (copied) {
        const long long* prev = hist_at(c, env, 6, b, sg);
        for (int t = threadIdx.x; t < copied; t += blockDim.x) out[t] = prev[t];
      }
      for (int t = threadIdx.x; t < kSampleBins; t += blockDim.x) {
        out[copied + t] = s.cnt[t];
        out[copied + kSampleBins + t] = static_cast<long long>(s.mass[t]);
      }
    }
  }
  __syncthreads();  // s is rewritten by the next task
}

// Inputs: logits [B, V] (T), then [B] temperature, top_k, top_p, min_p, seed, counter, then
// partials [B, S, 2 + 2·256] and the last sample_digit op's levels 2 … D [B, S, (D − 1)·2·256];
// output tokens [B] (int64).
// iparam[0]: the segment length.
template <typename T>
__device__ __noinline__ void sample_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T)), kLevels = static_cast<int>(sizeof(T));
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(scratch());
  const ViewC& x = c.in[0];
  const long long V = x.shape[1], seg = c.iparam[0], S = c.in[7].shape[1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    sample_plan<T>(c, env, b, 7, kLevels, V, s);
    const SamplePlan pl = s.plan;
    if (pl.greedy) {
      if (threadIdx.x == 0) store_i(env.buffers[c.out_buffer], c.out_dtype, b, pl.token);
      continue;
    }
    // each segment's kept mass, in its units: digits above the selected one at every level, and
    // the last level's selected bin (a warp a segment, its lanes over the bins)
    for (long long j = warp; j < S; j += warps) {
      unsigned long long kept = 0;
      for (int level = 1; level <= kLevels; ++level) {
        const long long* h = level_at(c, env, 7, level, b, j) + kSampleBins;
        const unsigned d = pl.digit[level - 1];
        for (int t = lane; t < kSampleBins; t += 32)
          if (t > d || (level == kLevels && t == d)) kept += static_cast<unsigned long long>(h[t]);
      }
      kept = warp_sum_u64(kept);
      if (lane == 0) s.kept[j] = kept;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the segment holding ⌊u·W⌋ in id order, and the rest in its units
      unsigned long long W = 0;
      for (long long j = 0; j < S; ++j) W += s.kept[j] >> s.shift[j];
      const unsigned long long u24 = mix64(mix64(static_cast<unsigned long long>(param_i(c, env, 5, b))) +
                                           static_cast<unsigned long long>(param_i(c, env, 6, b))) >> 40;
      const unsigned long long target = (W >> 24) * u24 + (((W & 0xffffffull) * u24) >> 24);  // ⌊W·u⌋, exact
      unsigned long long before = 0;
      long long j = 0;
      for (; j < S - 1; ++j) {
        const unsigned long long kj = s.kept[j] >> s.shift[j];
        if (before + kj > target) break;
        before += kj;
      }
      s.pick_seg = W > 0 ? j : -1;
      s.pick_rest = (target - before) << s.shift[j];
    }
    __syncthreads();
    const long long j = s.pick_seg;
    if (j < 0) {  // no mass at all (a row of -inf): the argmax
      if (threadIdx.x == 0) store_i(env.buffers[c.out_buffer], c.out_dtype, b, pl.token);
      continue;
    }
    // the segment's kept tokens in id order: thread t scans words [t·per, (t + 1)·per)
    const long long first = j * seg, len = (V < first + seg ? V : first + seg) - first, words = len / kE;
    const long long per = (words + blockDim.x - 1) / blockDim.x, w0 = threadIdx.x * per;
    long long idx[kMaxDims] = {b, first};
    const uint4* pv = reinterpret_cast<const uint4*>(static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, 2));
    const float ref = s.ref[j];
    const auto word_mass = [&](long long w, unsigned long long (&m)[kE]) {
      const uint4 raw = pv[w];
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kE; ++i) m[i] = sample_key(v[i]) >= pl.prefix ? sample_mass(to_f(v[i]), pl.scale, ref) : 0;
    };
    unsigned long long mine = 0;
    for (long long w = w0; w < w0 + per && w < words; ++w) {
      unsigned long long m[kE];
      word_mass(w, m);
#pragma unroll
      for (int i = 0; i < kE; ++i) mine += m[i];
    }
    unsigned long long incl = mine;  // the block's inclusive scan, in thread order
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s.red_u[warp] = incl;
    __syncthreads();
    for (int i = 0; i < warp; ++i) incl += s.red_u[i];
    const unsigned long long rest = s.pick_rest;
    if (incl - mine <= rest && rest < incl) {  // the thread whose tokens pass rest
      unsigned long long run = incl - mine;
      for (long long w = w0;; ++w) {
        unsigned long long m[kE];
        word_mass(w, m);
        int i = 0;
        while (i < kE && run + m[i] <= rest) run += m[i++];
        if (i < kE) {
          store_i(env.buffers[c.out_buffer], c.out_dtype, b, first + w * kE + i);
          break;
        }
      }
    }
    __syncthreads();  // s is rewritten by the next row
  }
}

}  // namespace mpk

// Task family: sampling (mpk.ops.sampling). ``sample_partial``: each SEGMENT-long segment of a row
// of logits [B, V] gives its max and first index of it, a (row, segment) tile a task, so a row's
// read for the max is spread over ⌈V / SEGMENT⌉ workers. ``sample``: one token per row under the
// row's temperature, top-k, top-p, min-p, seed and counter — mpk.engine.sampling.sample's
// semantics. The row's max and argmax come from the partials (a greedy row, temperature ≤ 0,
// ends there: the first maximal index, as torch.argmax, and reads no logit); a sampled row takes
// the whole CTA and sorts nothing:
//
//  * radix passes, 8 bits of the logits' own bits a pass (2 for bf16/f16, 4 for float32): top-k's
//    threshold, the k-th largest logit, by exact counting (as sort.cuh's select_candidates); top-p's,
//    the smallest logit whose strictly larger logits hold less than p of the mass, by summing each
//    digit's mass. The mass of a token is e = 2^((x − max)·log2(e)/T) ∈ [0, 1] in fixed point
//    (round(e·2^40), an integer): integer sums are exact and the same in any order, so a row's
//    thresholds and token do not depend on how its atomics interleave (same seed and counter, same
//    token, bit for bit). The first top-p pass also sums the row's total mass Z;
//  * the kept tokens (logit ≥ both thresholds, e ≥ min_p: p ≥ min_p · p_max since e_max = 1) add
//    their masses per group of 32 words (a warp's load) in shared memory;
//  * one warp finds the group where the kept mass, in token-id order, first exceeds
//    ⌊u · W⌋ (W the kept total, u the 24-bit counter-based uniform, so the product is exact),
//    then the token inside it: the reference's inverse CDF in id order.
//
// Thresholds are logits, so boundary ties are kept, as the reference keeps equal probabilities.
// The reference decides in float32 probabilities; the two differ only where rounding decides (a
// top-p cut or a draw within a rounding of a CDF step, or distinct logits whose probabilities
// round equal at a boundary). Cost of a sampled row (bf16, V = 151,936, 297 KiB): temperature /
// min-p 1 pass over the row, top-k / top-p / both 3 (float32: twice the bytes and two more radix
// passes), plus one group of 32 words.
#pragma once
#include "common.cuh"
#include "rows.cuh"

namespace mpk {

constexpr int kSampleGroups = 1024;  // kept-mass groups in shared memory (a longer row's groups hold more words)
constexpr float kMassOne = 1099511627776.f;  // 2^40: the fixed-point mass of probability p_max
// ≤ 2^40 a token, so a row of up to 2^23 tokens sums in 64 bits; a token under 2^-40 of p_max weighs 0

struct SampleSmem {
  unsigned long long group[kSampleGroups];
  unsigned long long mass_hist[256];
  unsigned count_hist[256];
  unsigned long long red_u[32];
  unsigned k_digit, p_digit;
  unsigned k_above;
  unsigned long long p_above;
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

// A token's fixed-point mass: e·2^40 with e = 2^((x − max)·scale), scale = log2(e)/temperature.
// One function for every pass, so the group sums and the final scan see the same integers.
__device__ __forceinline__ unsigned long long sample_mass(float x, float max, float scale) {
  return __float2ull_rn(exp2f((x - max) * scale) * kMassOne);
}

// f(v, w, valid) for every 16-byte word w of the row at p (words of kE raw elements v) that
// this thread owns, in increasing order; every lane of a warp makes the same calls (valid false
// past the end) so f may use warp votes, and the warp's 32 words of a call are consecutive,
// starting at a multiple of 32. Rounds of kRowInFlight words are double-buffered (rows.cuh).
template <typename T, typename F>
__device__ __forceinline__ void for_row_raw(const T* p, long long words, F f) {
  const uint4* pv = reinterpret_cast<const uint4*>(p);
  const long long step = blockDim.x, warp0 = threadIdx.x & ~31;
  const auto load = [&](uint4 (&raw)[kRowInFlight], long long base) {
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) {
      const long long w = base + u * step + threadIdx.x;
      raw[u] = w < words ? pv[w] : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 cur[kRowInFlight], nxt[kRowInFlight];
  load(cur, 0);
  for (long long base = 0; base < words; base += kRowInFlight * step) {
    load(nxt, base + kRowInFlight * step);
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) {
      if (base + u * step + warp0 >= words) break;  // the warp's words are all past the end
      const long long w = base + u * step + threadIdx.x;
      f(reinterpret_cast<const T*>(&cur[u]), w, w < words);
    }
#pragma unroll
    for (int u = 0; u < kRowInFlight; ++u) cur[u] = nxt[u];
  }
}

// One candidate's radix digit into a count histogram (a warp's equal digits in one atomic).
__device__ __forceinline__ void count_digit(unsigned* hist, bool cand, unsigned key, int shift) {
  const unsigned d = cand ? (key >> shift) & 255 : 256;
  const unsigned peers = __match_any_sync(0xffffffffu, d);
  if (cand && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
}

// One candidate's mass m (≤ 2^40) into its digit's bin: a warp's equal digits summed with two
// 32-bit reductions (26 low bits and the rest: 32 of each fit) and added in one atomic.
__device__ __forceinline__ void mass_digit(unsigned long long* hist, bool cand, unsigned key, int shift,
                                           unsigned long long m) {
  if (!__any_sync(0xffffffffu, cand)) return;
  const unsigned d = cand ? (key >> shift) & 255 : 256;
  const unsigned peers = __match_any_sync(0xffffffffu, d);
  const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(m & 0x3ffffffu));
  const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(m >> 26));
  if (cand && (threadIdx.x & 31) == __ffs(peers) - 1)
    atomicAdd(&hist[d], (static_cast<unsigned long long>(hi) << 26) + lo);
}

// Warp 0: the digit, walking hist from 255 down, where the running total first reaches need
// (≥ 1, ≤ the histogram's total): *digit, and *above the total of the digits above it.
template <typename C>
__device__ __forceinline__ void select_digit(const C* hist, C need, unsigned* digit, C* above_out) {
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
  if (above < need && need <= incl)
    for (int i = 0; i < 8; ++i) {
      if (above + c[i] >= need) {
        *digit = 255 - 8 * lane - i;
        *above_out = above;
        break;
      }
      above += c[i];
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

// Inputs: logits [B, V] (T, contiguous rows of whole 16-byte words: codegen checks); output
// partials [B, S, 2] float32: segment s's max and its first index (as a float: V < 2^24, codegen
// checks), torch.argmax's order. iparam[0]: the segment length (mpk.ops.sampling.SEGMENT, a
// multiple of the words' elements).
template <typename T>
__device__ __noinline__ void sample_partial(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kE = 16 / static_cast<int>(sizeof(T));
  float* red_f = scratch();  // one (max, index) per warp
  long long* red_i = reinterpret_cast<long long*>(red_f + 32);
  const ViewC& x = c.in[0];
  const long long V = x.shape[1], seg = c.iparam[0];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  for (long long b = r.lo[0]; b < r.hi[0]; ++b)
    for (long long s = r.lo[1]; s < r.hi[1]; ++s) {
      long long idx[kMaxDims] = {b, s * seg};
      const long long first = s * seg, len = (V < first + seg ? V : first + seg) - first;
      const T* p = static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, 2);
      float acc = -INFINITY;
      long long arg = first;
      for_row_raw<T>(p, len / kE, [&](const T* v, long long w, bool valid) {
        if (!valid) return;
#pragma unroll
        for (int i = 0; i < kE; ++i) argmax_add(acc, arg, to_f(v[i]), first + w * kE + i);
      });
      warp_argmax(acc, arg);
      if (lane == 0) {
        red_f[warp] = acc;
        red_i[warp] = arg;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int i = 1; i < warps; ++i)
          if (argmax_before(red_f[i], red_i[i], acc, arg)) {
            acc = red_f[i];
            arg = red_i[i];
          }
        float* out = static_cast<float*>(env.buffers[c.out_buffer]);
        const long long o = (b * c.out_shape[1] + s) * 2;  // (b, s) of [B, S, 2], a fresh contiguous buffer
        out[o] = acc;
        out[o + 1] = static_cast<float>(arg);
      }
      __syncthreads();  // red_* is rewritten by the next segment
    }
}

// Inputs: logits [B, V] (T, contiguous rows of whole 16-byte words: codegen checks), then [B]
// temperature, top_k, top_p, min_p, seed, counter, then sample_partial's partials [B, S, 2];
// output tokens [B] (int64). T: the logits' type.
template <typename T>
__device__ __noinline__ void sample_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  static_assert(sizeof(SampleSmem) <= kScratchFloats * sizeof(float), "sampling state exceeds the task scratch");
  constexpr int kE = 16 / static_cast<int>(sizeof(T)), kBits = 8 * static_cast<int>(sizeof(T)),
                kDigits = static_cast<int>(sizeof(T));
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(scratch());
  const ViewC& x = c.in[0];
  const long long V = x.shape[1], words = V / kE;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  // group g holds words [32·gsz·g, 32·gsz·(g + 1)): a warp's call of for_row_raw lies in one group
  const long long gsz = ((words + 31) / 32 + kSampleGroups - 1) / kSampleGroups;
  const int ngroups = static_cast<int>((words + 32 * gsz - 1) / (32 * gsz));
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    long long idx[kMaxDims] = {b, 0};
    const auto ldi = [&](int i) { return load_i(env.buffers[c.in[i].buffer], c.in[i].dtype, view_index(c.in[i], idx, 1)); };
    const float temperature = ld(c, env, 1, idx), top_p = ld(c, env, 3, idx), min_p = ld(c, env, 4, idx);
    const long long top_k = ldi(2);
    const unsigned long long seed = static_cast<unsigned long long>(ldi(5)),
                             counter = static_cast<unsigned long long>(ldi(6));
    const T* p = static_cast<const T*>(env.buffers[x.buffer]) + view_index(x, idx, 2);
    const bool greedy = !(temperature > 0.f);
    const bool use_k = !greedy && top_k > 0 && top_k < V, use_p = !greedy && top_p < 1.f;
    unsigned k_prefix = 0, k_mask = 0, k_greater = 0, p_prefix = 0, p_mask = 0;
    unsigned long long p_above = 0, z = 0;

    // the row's max and argmax from its segments' partials, in segment order (torch.argmax's)
    const ViewC& part = c.in[7];
    const void* pbuf = env.buffers[part.buffer];
    float acc = -INFINITY;
    long long arg = 0;
    for (long long s = 0; s < part.shape[1]; ++s) {
      long long pidx[3] = {b, s, 0};
      const float m = load_f(pbuf, part.dtype, view_index(part, pidx, 3));
      pidx[2] = 1;
      const long long a = static_cast<long long>(load_f(pbuf, part.dtype, view_index(part, pidx, 3)));
      if (s == 0 || argmax_before(m, a, acc, arg)) {
        acc = m;
        arg = a;
      }
    }
    if (greedy) {
      if (threadIdx.x == 0) store_i(env.buffers[c.out_buffer], c.out_dtype, b, arg);
      continue;  // (s untouched)
    }
    const float max = acc, scale = 1.4426950408889634f / temperature;
    int k_digits = use_k ? 0 : kDigits, p_digits = use_p ? 0 : kDigits;  // digits of each threshold found
    unsigned long long p_target = 0;  // ⌈top_p · Z⌉: top-p keeps the logits whose larger ones weigh less
    for (int pass = 0; k_digits < kDigits || p_digits < kDigits; ++pass) {
      __syncthreads();
      if (pass > 0 && k_digits < kDigits) {  // the digit selected in the previous pass
        const int shift = kBits - 8 * (k_digits + 1);
        k_prefix |= s.k_digit << shift;
        k_mask |= 255u << shift;
        k_greater += s.k_above;
        ++k_digits;
      }
      if (pass > 0 && p_digits < kDigits) {
        const int shift = kBits - 8 * (p_digits + 1);
        p_prefix |= s.p_digit << shift;
        p_mask |= 255u << shift;
        p_above += s.p_above;
        ++p_digits;
      }
      const bool do_k = k_digits < kDigits, do_p = p_digits < kDigits, first_p = do_p && p_digits == 0;
      if (!do_k && !do_p) break;
      for (int t = threadIdx.x; t < 256; t += blockDim.x) {
        s.count_hist[t] = 0;
        s.mass_hist[t] = 0;
      }
      __syncthreads();
      const int k_shift = kBits - 8 * (k_digits + 1), p_shift = kBits - 8 * (p_digits + 1);
      for_row_raw<T>(p, words, [&](const T* v, long long, bool valid) {
#pragma unroll
        for (int i = 0; i < kE; ++i) {
          const unsigned key = sample_key(v[i]);
          if (do_k) count_digit(s.count_hist, valid && (key & k_mask) == k_prefix, key, k_shift);
          if (do_p) {
            const bool cand = valid && (key & p_mask) == p_prefix;
            // the first top-p pass weighs every token (Z); later ones only the candidates
            const unsigned long long m = cand || (first_p && valid) ? sample_mass(to_f(v[i]), max, scale) : 0;
            z += m;
            mass_digit(s.mass_hist, cand, key, p_shift, m);
          }
        }
      });
      if (first_p) {  // Z, summed over the warps in warp order
        z = warp_sum_u64(z);
        if (lane == 0) s.red_u[warp] = z;
      }
      __syncthreads();
      if (first_p) {
        unsigned long long total = 0;
        for (int i = 0; i < warps; ++i) total += s.red_u[i];
        p_target = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(total)));
        p_target = p_target < 1 ? 1 : p_target;
      }
      if (warp == 0) {
        if (do_k) select_digit<unsigned>(s.count_hist, static_cast<unsigned>(top_k) - k_greater, &s.k_digit, &s.k_above);
        if (do_p) select_digit<unsigned long long>(s.mass_hist, p_target - p_above, &s.p_digit, &s.p_above);
      }
    }
    const unsigned threshold = k_prefix > p_prefix ? k_prefix : p_prefix;  // (an unused one is 0)

    // the kept tokens' mass per group
    for (int g = threadIdx.x; g < ngroups; g += blockDim.x) s.group[g] = 0;
    __syncthreads();
    const auto word_masses = [&](const T* v, bool valid, unsigned long long (&m)[kE]) {
#pragma unroll
      for (int i = 0; i < kE; ++i) {
        m[i] = 0;
        if (valid && sample_key(v[i]) >= threshold) {
          const float xi = to_f(v[i]);
          if (exp2f((xi - max) * scale) >= min_p) m[i] = sample_mass(xi, max, scale);
        }
      }
    };
    for_row_raw<T>(p, words, [&](const T* v, long long w, bool valid) {
      unsigned long long m[kE], sum = 0;
      word_masses(v, valid, m);
#pragma unroll
      for (int i = 0; i < kE; ++i) sum += m[i];
      if (!__any_sync(0xffffffffu, sum != 0)) return;
      sum = warp_sum_u64(sum);
      if (lane == 0) atomicAdd(&s.group[w / 32 / gsz], sum);
    });
    __syncthreads();

    // inverse CDF in id order: the first token whose running kept mass exceeds ⌊u · W⌋
    if (warp == 0) {
      const int per = (ngroups + 31) / 32;
      unsigned long long sum = 0;
      for (int g = lane * per; g < ngroups && g < (lane + 1) * per; ++g) sum += s.group[g];
      unsigned long long incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const unsigned long long W = __shfl_sync(0xffffffffu, incl, 31);
      const unsigned long long u24 = mix64(mix64(seed) + counter) >> 40;  // uniform = u24 / 2^24
      const unsigned long long target = (W >> 24) * u24 + (((W & 0xffffffull) * u24) >> 24);  // ⌊W·u⌋, exact
      const int owner = __ffs(__ballot_sync(0xffffffffu, incl > target)) - 1;  // W > target: some lane
      int group = 0;
      unsigned long long before = incl - sum;  // kept mass before the group found
      if (lane == owner)
        for (int g = lane * per;; ++g) {
          if (before + s.group[g] > target) {
            group = g;
            break;
          }
          before += s.group[g];
        }
      group = __shfl_sync(0xffffffffu, group, owner);
      before = __shfl_sync(0xffffffffu, before, owner);
      const uint4* pv = reinterpret_cast<const uint4*>(p);
      for (long long w0 = group * 32 * gsz; w0 < (group + 1) * 32 * gsz; w0 += 32) {
        const long long w = w0 + lane;
        const uint4 raw = w < words ? pv[w] : make_uint4(0, 0, 0, 0);
        unsigned long long m[kE], wsum = 0;
        word_masses(reinterpret_cast<const T*>(&raw), w < words, m);
#pragma unroll
        for (int i = 0; i < kE; ++i) wsum += m[i];
        unsigned long long winc = wsum;
        for (int o = 1; o < 32; o <<= 1) {
          const unsigned long long v = __shfl_up_sync(0xffffffffu, winc, o);
          if (lane >= o) winc += v;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, before + winc > target);
        if (hit) {
          if (lane == __ffs(hit) - 1) {
            unsigned long long run = before + winc - wsum;
            int i = 0;
            while (run + m[i] <= target) run += m[i++];  // ends: this word's mass passes target
            store_i(env.buffers[c.out_buffer], c.out_dtype, b, w * kE + i);
          }
          break;
        }
        before += __shfl_sync(0xffffffffu, winc, 31);
      }
    }
    __syncthreads();  // s is rewritten by the next row
  }
}

}  // namespace mpk

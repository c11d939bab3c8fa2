// Task family: decode over a paged KV cache (mpk/ops/paged.py documents the layout and the
// page table). ``rope_append``: qk-norm + RoPE of one token per sequence and its k/v appended
// to the cache; ``attn_partial``: the (O, LSE) state of a kv head's G query heads over one KV
// chunk; ``attn_merge``: ⊕ of a head's chunk states in chunk order.
//
// LSE base 2 everywhere: lse = log2 Σ 2^s with s = q·k·scale·log2(e); O is normalised; the
// empty state is (O = 0, lse = −inf). merge_state below is the only CUDA definition of ⊕.
#pragma once
#include <type_traits>

#include "common.cuh"

namespace mpk {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kAttnRegs = 32;  // per-lane registers for q (and for the accumulator): G·D/32 ≤ 32

// (o_a, lse_a) ⊕ (o_b, lse_b) for one element of O; returns the new lse through lse_a.
__device__ __forceinline__ float merge_state(float o_a, float& lse_a, float o_b, float lse_b) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return 0.f;  // both empty: the identity, no NaN from inf − inf
  const float w_a = exp2f(lse_a - m), w_b = exp2f(lse_b - m), s = w_a + w_b;
  lse_a = m + log2f(s);
  return (w_a * o_a + w_b * o_b) / s;
}

// Length of sequence b of a BSR page table.
__device__ __forceinline__ long long seq_len(const TaskEnv& env, const ViewC& indptr, const ViewC& last, long long b,
                                             int page_size) {
  // three independent loads (one round trip), not two dependent ones
  const long long p0 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + b * indptr.stride[0]);
  const long long p1 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + (b + 1) * indptr.stride[0]);
  const long long tail = load_i(env.buffers[last.buffer], last.dtype, last.offset + b * last.stride[0]);
  return p1 <= p0 ? 0 : (p1 - p0 - 1) * page_size + tail;
}

// Element offset of cache[layer, kv, page(b, t), head, slot(t), 0] (the cache view is the
// whole input buffer: strides come from the view).
__device__ __forceinline__ long long cache_row(const TaskEnv& env, const ViewC& cache, const ViewC& indptr,
                                               const ViewC& indices, long long b, long long t, int layer, int kv,
                                               long long head, int page_shift) {
  const long long p0 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + b * indptr.stride[0]);
  const long long page = load_i(env.buffers[indices.buffer], indices.dtype,
                                indices.offset + (p0 + (t >> page_shift)) * indices.stride[0]);
  const long long slot = t & ((1LL << page_shift) - 1);
  return cache.offset + layer * cache.stride[0] + kv * cache.stride[1] + page * cache.stride[2] +
         head * cache.stride[3] + slot * cache.stride[4];
}

__device__ __forceinline__ int log2_pow2(int x) { return 31 - __clz(x); }

// Element offset of (page of position t, slot of t) within one layer/kv/head of the cache.
__device__ __forceinline__ long long page_row(const TaskEnv& env, const ViewC& indices, long long p0, long long t,
                                              int shift, const ViewC& cache) {
  const long long page = load_i(env.buffers[indices.buffer], indices.dtype,
                                indices.offset + (p0 + (t >> shift)) * indices.stride[0]);
  return page * cache.stride[2] + (t & ((1LL << shift) - 1)) * cache.stride[4];
}

// kPer consecutive elements of a cache row into floats: one vector load for bf16 rows with
// unit stride (the layout the model allocates), element loads otherwise.
template <int kPer>
__device__ __forceinline__ void load_row(const void* base, const ViewC& v, long long off, float* out) {
  if (v.dtype == kBF16 && v.stride[5] == 1 && off % kPer == 0) {
    const auto* p = static_cast<const __nv_bfloat16*>(base) + off;
    if constexpr (kPer == 2) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
      out[0] = f.x, out[1] = f.y;
    } else {
      using Vec = std::conditional_t<kPer == 4, uint2, uint4>;
      const Vec raw = *reinterpret_cast<const Vec*>(p);
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer / 2; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) out[i] = load_f(base, v.dtype, off + i * v.stride[5]);
}

// inputs: qkv [B, (H+2KV)·D], cos_sin [P, D] (cos | sin), kv_indptr, kv_indices,
// kv_last_page_len, kv_cache, q_norm [D], k_norm [D] (when iparam[4]); output q [B, H, D].
// iparam: heads, kv_heads, head_dim, page_size, qk_norm, layer; fparam[0] eps.
// A tile covers query heads [h0, h1) and appends the k/v of the kv heads whose group starts
// in it (mpk/ops/paged.py: kv_heads_of_tile). One warp per (sequence, head); lane l holds dims
// l + 32·i, so the rotate-half partner of a dim sits in the same lane (D is a multiple of 64).
__device__ void task_rope_append(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC &qkv = c.in[0], &cs = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4],
              &cache = c.in[5];
  const int H = static_cast<int>(c.iparam[0]), KV = static_cast<int>(c.iparam[1]);
  const int D = static_cast<int>(c.iparam[2]), page_size = static_cast<int>(c.iparam[3]);
  const bool qk_norm = c.iparam[4] != 0;
  const int layer = static_cast<int>(c.iparam[5]);
  const int per = D / 32, half = per / 2;
  const int lane = threadIdx.x & 31;
  const int group = H / KV, h0 = static_cast<int>(r.lo[1]), h1 = static_cast<int>(r.hi[1]);
  const int kv0 = (h0 + group - 1) / group, kv1 = (h1 + group - 1) / group;
  const int per_row = (h1 - h0) + 2 * (kv1 - kv0);
  const int rows = static_cast<int>(r.hi[0] - r.lo[0]) * per_row;
  for (int job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long b = r.lo[0] + job / per_row;
    const int j = job % per_row, jj = j - (h1 - h0);
    const int head = j < h1 - h0 ? h0 + j : H + (jj & 1) * KV + kv0 + jj / 2;  // q, else k / v of a kv head
    float x[8];  // the row is loaded first: it does not depend on the page table
    const long long row = qkv.offset + b * qkv.stride[0] + static_cast<long long>(head) * D * qkv.stride[1];
    for (int i = 0; i < per; ++i) x[i] = load_f(env.buffers[qkv.buffer], qkv.dtype, row + (lane + 32 * i) * qkv.stride[1]);
    const long long pos = seq_len(env, indptr, last, b, page_size) - 1;
    // the page table does not count the token being decoded, or the position is past the table
    if (pos < 0 || pos >= cs.shape[0]) __trap();
    if (head < H + KV) {  // q or k: qk-norm (HF rounding: normalise, round, scale, round), RoPE
      if (qk_norm) {
        float ss = 0.f;
        for (int i = 0; i < per; ++i) ss += x[i] * x[i];
        const float rstd = rsqrtf(warp_sum(ss) / D + c.fparam[0]);
        const ViewC& w = c.in[head < H ? 6 : 7];
        for (int i = 0; i < per; ++i) {
          const float wv = load_f(env.buffers[w.buffer], w.dtype, w.offset + (lane + 32 * i) * w.stride[0]);
          x[i] = round_to(c.out_dtype, round_to(c.out_dtype, x[i] * rstd) * wv);
        }
      }
      const long long crow = cs.offset + pos * cs.stride[0];
      float y[8];
      for (int i = 0; i < per; ++i) {
        const int d = lane + 32 * i, f = i < half ? d : d - D / 2;
        const float cv = load_f(env.buffers[cs.buffer], cs.dtype, crow + f * cs.stride[1]);
        const float sv = load_f(env.buffers[cs.buffer], cs.dtype, crow + (f + D / 2) * cs.stride[1]);
        const float rot = i < half ? -x[i + half] : x[i - half];
        y[i] = x[i] * cv + rot * sv;
      }
      for (int i = 0; i < per; ++i) x[i] = y[i];
    }
    if (head < H) {
      const long long out = (b * H + head) * static_cast<long long>(D);
      for (int i = 0; i < per; ++i) store_f(env.buffers[c.out_buffer], c.out_dtype, out + lane + 32 * i, x[i]);
    } else {
      const int kv = head < H + KV ? 0 : 1;
      const long long base = cache_row(env, cache, indptr, indices, b, pos, layer, kv, head - H - kv * KV,
                                       log2_pow2(page_size));
      for (int i = 0; i < per; ++i)
        store_f(env.buffers[cache.buffer], cache.dtype, base + (lane + 32 * i) * cache.stride[5], x[i]);
    }
  }
}

// inputs: q [B, H, D], kv_cache, kv_indptr, kv_indices, kv_last_page_len;
// output states [B, KV, C, G, D+1] fp32; iparam: layer, page_size; fparam[0] scale.
// Each of the 8 warps runs an online softmax over every 8th position of the chunk for all G
// query heads (a K/V row is loaded once per warp and used by every head); the warps' states
// are then combined in a fixed order through shared memory.
template <int kPer>
__device__ __noinline__ void attn_partial_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC &q = c.in[0], &cache = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4];
  constexpr int kMaxG = kAttnRegs / kPer;
  const int KV = static_cast<int>(c.out_shape[1]), C = static_cast<int>(c.out_shape[2]);
  const int G = static_cast<int>(c.out_shape[3]), D = kPer * 32;
  const int layer = static_cast<int>(c.iparam[0]), page_size = static_cast<int>(c.iparam[1]);
  const int shift = log2_pow2(page_size);
  const float scale = c.fparam[0] * kLog2e;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* red = scratch();  // [warps][G][D + 2]: m, l, acc
  const void* kvbase = env.buffers[cache.buffer];
  const long long layer_off = cache.offset + layer * cache.stride[0];
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    const long long n = seq_len(env, indptr, last, b, page_size);
    const long long p0 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + b * indptr.stride[0]);
    for (long long kvh = r.lo[1]; kvh < r.hi[1]; ++kvh) {
      for (long long ch = r.lo[2]; ch < r.hi[2]; ++ch) {
        const long long t0 = ch * n / C, t1 = (ch + 1) * n / C;
        float qr[kAttnRegs], acc[kAttnRegs], m[kMaxG], l[kMaxG];
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
          m[g] = -INFINITY;
          l[g] = 0.f;
#pragma unroll
          for (int i = 0; i < kPer; ++i) {
            acc[g * kPer + i] = 0.f;
            const long long qi = q.offset + b * q.stride[0] + (kvh * G + g) * q.stride[1] + (lane * kPer + i) * q.stride[2];
            qr[g * kPer + i] = g < G ? load_f(env.buffers[q.buffer], q.dtype, qi) * scale : 0.f;
          }
        }
        // two positions per warp per step: their page lookups and K/V loads are independent
        for (long long t = t0 + warp; t < t1; t += 2 * warps) {
          const bool second = t + warps < t1;
          float kr[2][kPer], vr[2][kPer];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const long long tu = u == 0 || second ? t + u * warps : t;
            const long long krow = page_row(env, indices, p0, tu, shift, cache) + kvh * cache.stride[3] + layer_off;
            load_row<kPer>(kvbase, cache, krow + lane * kPer * cache.stride[5], kr[u]);
            load_row<kPer>(kvbase, cache, krow + cache.stride[1] + lane * kPer * cache.stride[5], vr[u]);
          }
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            if (u == 1 && !second) break;
#pragma unroll
            for (int g = 0; g < kMaxG; ++g) {
              if (g >= G) break;
              float s = 0.f;
#pragma unroll
              for (int i = 0; i < kPer; ++i) s += qr[g * kPer + i] * kr[u][i];
              s = warp_sum(s);
              const float m_new = fmaxf(m[g], s), corr = exp2f(m[g] - m_new), p = exp2f(s - m_new);
              l[g] = l[g] * corr + p;
#pragma unroll
              for (int i = 0; i < kPer; ++i) acc[g * kPer + i] = acc[g * kPer + i] * corr + p * vr[u][i];
              m[g] = m_new;
            }
          }
        }
        // combine the warps' states in warp order (deterministic)
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
          if (g >= G) break;
          float* w = red + (warp * G + g) * (D + 2);
          if (lane == 0) {
            w[0] = m[g];
            w[1] = l[g];
          }
#pragma unroll
          for (int i = 0; i < kPer; ++i) w[2 + lane * kPer + i] = acc[g * kPer + i];
        }
        __syncthreads();
        float* out = static_cast<float*>(env.buffers[c.out_buffer]) + ((b * KV + kvh) * C + ch) * G * (D + 1);
        for (int e = threadIdx.x; e < G * (D + 1); e += blockDim.x) {
          const int g = e / (D + 1), d = e % (D + 1);
          float mx = -INFINITY;
          for (int w = 0; w < warps; ++w) mx = fmaxf(mx, red[(w * G + g) * (D + 2)]);
          float sum = 0.f, o = 0.f;
          if (mx != -INFINITY) {
            for (int w = 0; w < warps; ++w) {
              const float* s = red + (w * G + g) * (D + 2);
              const float f = exp2f(s[0] - mx);
              sum += s[1] * f;
              if (d < D) o += s[2 + d] * f;
            }
          }
          out[e] = d < D ? (sum > 0.f ? o / sum : 0.f) : (sum > 0.f ? mx + log2f(sum) : -INFINITY);
        }
        __syncthreads();
      }
    }
  }
}

__device__ void task_attn_partial(const OpC& c, const Rect& r, const TaskEnv& env) {
  switch (c.in[0].shape[2]) {  // head dim; codegen admits only these
    case 64: attn_partial_impl<2>(c, r, env); return;
    case 128: attn_partial_impl<4>(c, r, env); return;
    case 256: attn_partial_impl<8>(c, r, env); return;
    default: __trap();
  }
}

// input states [B, KV, C, G, D+1]; output [B, H, D]. One warp per (b, h); lanes over D.
__device__ void task_attn_merge(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& st = c.in[0];
  const int C = static_cast<int>(st.shape[2]), G = static_cast<int>(st.shape[3]), D1 = static_cast<int>(st.shape[4]);
  const int D = D1 - 1, H = static_cast<int>(c.out_shape[1]);
  const long long heads = r.hi[1] - r.lo[1];
  const long long rows = (r.hi[0] - r.lo[0]) * heads;
  const int lane = threadIdx.x & 31;
  const float* states = static_cast<const float*>(env.buffers[st.buffer]) + st.offset;
  for (long long job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long b = r.lo[0] + job / heads, h = r.lo[1] + job % heads;
    const long long kvh = h / G, g = h % G;
    for (int d0 = 0; d0 < D; d0 += 32) {
      const int d = d0 + lane;
      float o = 0.f, lse = -INFINITY;
#pragma unroll 4
      for (int ch = 0; ch < C; ++ch) {
        const float* s = states + (((b * st.shape[1] + kvh) * C + ch) * G + g) * D1;
        o = merge_state(o, lse, d < D ? s[d] : 0.f, s[D]);
      }
      if (d < D) store_f(env.buffers[c.out_buffer], c.out_dtype, (b * H + h) * D + d, o);
    }
  }
}

}  // namespace mpk

// Task family: decode over a paged KV cache (mpk/ops/paged.py documents the layout and the
// page table). ``rope_append``: qk-norm + RoPE of one token per sequence and its k/v appended
// to the cache; ``attn_partial``: the (O, LSE) state of a kv head's G query heads over one KV
// chunk; ``attn_merge``: ⊕ of a head's chunk states in chunk order.
//
// LSE base 2 everywhere: lse = log2 Σ 2^s with s = q·k·scale·log2(e); O is normalised; the
// empty state is (O = 0, lse = −inf). merge_state below is the only CUDA definition of ⊕.
//
// The tasks are templates over the head dim (kPer = D / 32 elements per lane), the group size
// G and the element type T of q, the cache and the rope inputs; codegen instantiates only the
// combinations of its graph (mpk.megakernel.codegen.SPECIALIZED). Straight-line typed code
// keeps each task's instructions few: the persistent kernel holds every task family, and a
// task whose code is not in the instruction cache pays for fetching it.
#pragma once
#include "common.cuh"

namespace mpk {

constexpr float kLog2e = 1.4426950408889634f;

// (o_a, lse_a) ⊕ (o_b, lse_b) for one element of O; returns the new lse through lse_a.
__device__ __forceinline__ float merge_state(float o_a, float& lse_a, float o_b, float lse_b) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return 0.f;  // both empty: the identity, no NaN from inf − inf
  const float w_a = exp2f(lse_a - m), w_b = exp2f(lse_b - m), s = w_a + w_b;
  lse_a = m + log2f(s);
  return (w_a * o_a + w_b * o_b) / s;
}

// Where sequence b's pages start in kv_indices, and its length.
struct SeqSpan {
  long long first_page, len;
};

__device__ __forceinline__ SeqSpan seq_span(const TaskEnv& env, const ViewC& indptr, const ViewC& last, long long b,
                                            int page_size) {
  // three independent loads: one round trip
  const long long p0 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + b * indptr.stride[0]);
  const long long p1 = load_i(env.buffers[indptr.buffer], indptr.dtype, indptr.offset + (b + 1) * indptr.stride[0]);
  const long long tail = load_i(env.buffers[last.buffer], last.dtype, last.offset + b * last.stride[0]);
  return SeqSpan{p0, p1 <= p0 ? 0 : (p1 - p0 - 1) * page_size + tail};
}

// Page holding position t of a sequence whose pages start at kv_indices[first_page].
__device__ __forceinline__ long long page_of(const TaskEnv& env, const ViewC& indices, long long first_page,
                                             long long t, int shift) {
  return load_i(env.buffers[indices.buffer], indices.dtype, indices.offset + (first_page + (t >> shift)) * indices.stride[0]);
}

__device__ __forceinline__ int log2_pow2(int x) { return 31 - __clz(x); }

// inputs: qkv [B, (H+2KV)·D], cos_sin [P, D] (cos | sin), kv_indptr, kv_indices,
// kv_last_page_len, kv_cache, q_norm [D], k_norm [D] (when iparam[4]); output q [B, H, D].
// iparam: heads, kv_heads, head_dim, page_size, qk_norm, layer; fparam[0] eps.
// A tile covers query heads [h0, h1) and appends the k/v of the kv heads whose group starts
// in it (mpk/ops/paged.py: kv_heads_of_tile). One warp per (sequence, head); lane l holds dims
// l + 32·i, so the rotate-half partner of a dim sits in the same lane. Two round trips: the
// row, the page-table entries and the norm weight together, then cos/sin and the page at the
// token's position.
template <int kPer, typename T>
__device__ __noinline__ void rope_append_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kHalf = kPer / 2, D = 32 * kPer;
  const ViewC &qkv = c.in[0], &cs = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4],
              &cache = c.in[5];
  const int H = static_cast<int>(c.iparam[0]), KV = static_cast<int>(c.iparam[1]);
  const int page_size = static_cast<int>(c.iparam[3]), shift = log2_pow2(page_size);
  const bool qk_norm = c.iparam[4] != 0;
  const long long layer_off = cache.offset + c.iparam[5] * cache.stride[0];
  const int lane = threadIdx.x & 31;
  const int group = H / KV, h0 = static_cast<int>(r.lo[1]), h1 = static_cast<int>(r.hi[1]);
  const int kv0 = (h0 + group - 1) / group, kv1 = (h1 + group - 1) / group;
  const int per_row = (h1 - h0) + 2 * (kv1 - kv0);
  const int rows = static_cast<int>(r.hi[0] - r.lo[0]) * per_row;
  for (int job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long b = r.lo[0] + job / per_row;
    const int j = job % per_row, jj = j - (h1 - h0);
    const int head = j < h1 - h0 ? h0 + j : H + (jj & 1) * KV + kv0 + jj / 2;  // q, else k / v of a kv head
    const bool rotate = head < H + KV, norm = qk_norm && rotate;
    const T* row = static_cast<const T*>(env.buffers[qkv.buffer]) + qkv.offset + b * qkv.stride[0] +
                   static_cast<long long>(head) * D;
    const T* wn = norm ? static_cast<const T*>(env.buffers[c.in[head < H ? 6 : 7].buffer]) + c.in[head < H ? 6 : 7].offset
                       : nullptr;
    float x[kPer], w[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      x[i] = to_f(row[lane + 32 * i]);
      w[i] = norm ? to_f(wn[lane + 32 * i]) : 1.f;
    }
    const SeqSpan s = seq_span(env, indptr, last, b, page_size);
    const long long pos = s.len - 1;
    // the page table does not count the token being decoded, or the position is past the table
    if (pos < 0 || pos >= cs.shape[0]) __trap();
    const long long page = head >= H ? page_of(env, indices, s.first_page, pos, shift) : 0;
    float cv[kPer], sv[kPer];
    if (rotate) {
      const T* crow = static_cast<const T*>(env.buffers[cs.buffer]) + cs.offset + pos * cs.stride[0];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int f = lane + 32 * (i < kHalf ? i : i - kHalf);  // the frequency of dim lane + 32·i
        cv[i] = to_f(crow[f]);
        sv[i] = to_f(crow[f + D / 2]);
      }
      if (norm) {  // qk-norm with HF's roundings: normalise, round, scale, round
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) ss += x[i] * x[i];
        const float rstd = rsqrtf(warp_sum(ss) / D + c.fparam[0]);
#pragma unroll
        for (int i = 0; i < kPer; ++i) x[i] = round_as<T>(round_as<T>(x[i] * rstd) * w[i]);
      }
      float y[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) y[i] = x[i] * cv[i] + (i < kHalf ? -x[i + kHalf] : x[i - kHalf]) * sv[i];
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = y[i];
    }
    T* out;
    if (head < H) {
      out = static_cast<T*>(env.buffers[c.out_buffer]) + (b * H + head) * static_cast<long long>(D);
    } else {
      const int kv = head < H + KV ? 0 : 1;
      out = static_cast<T*>(env.buffers[cache.buffer]) + layer_off + kv * cache.stride[1] + page * cache.stride[2] +
            (head - H - kv * KV) * cache.stride[3] + (pos & (page_size - 1)) * cache.stride[4];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = from_f<T>(x[i]);
  }
}

// inputs: q [B, H, D], kv_cache, kv_indptr, kv_indices, kv_last_page_len;
// output states [B, KV, C, G, D+1] fp32; iparam: layer, page_size; fparam[0] scale.
// Each of the warps runs an online softmax over its share of the chunk for all G query heads
// (a K/V row is loaded once per warp and used by every head); the warps' states are then
// combined in a fixed order through shared memory. A warp takes kU consecutive positions per
// step, their K and V rows all in flight at once (4 KB per warp), and the page-table entries of
// its next step are loaded during the current one, so a step costs one memory round trip.
template <int kPer, int kG, typename T>
__device__ __noinline__ void attn_partial_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int D = 32 * kPer, kU = 32 / kPer;
  const ViewC &q = c.in[0], &cache = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4];
  const int KV = static_cast<int>(c.out_shape[1]), C = static_cast<int>(c.out_shape[2]);
  const int page_size = static_cast<int>(c.iparam[1]), shift = log2_pow2(page_size);
  const float scale = c.fparam[0] * kLog2e;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* red = scratch();  // [warps][kG][D + 2]: m, l, acc
  const T* kvbase = static_cast<const T*>(env.buffers[cache.buffer]) + cache.offset + c.iparam[0] * cache.stride[0] +
                    lane * kPer;
  const T* qbase = static_cast<const T*>(env.buffers[q.buffer]) + q.offset + lane * kPer;
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    const SeqSpan span = seq_span(env, indptr, last, b, page_size);
    for (long long kvh = r.lo[1]; kvh < r.hi[1]; ++kvh) {
      const T* head_base = kvbase + kvh * cache.stride[3];
      for (long long ch = r.lo[2]; ch < r.hi[2]; ++ch) {
        const long long t0 = ch * span.len / C, t1 = (ch + 1) * span.len / C;
        float qr[kG][kPer], acc[kG][kPer], m[kG], l[kG];
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          load_vec<kPer>(qbase + b * q.stride[0] + (kvh * kG + g) * q.stride[1], qr[g]);
          m[g] = -INFINITY;
          l[g] = 0.f;
#pragma unroll
          for (int i = 0; i < kPer; ++i) {
            qr[g][i] *= scale;
            acc[g][i] = 0.f;
          }
        }
        long long base = t0 + warp * kU;
        const int mine = lane % kU;  // the position of the step whose page this lane looks up
        long long page = base + mine < t1 ? page_of(env, indices, span.first_page, base + mine, shift) : 0;
        for (; base < t1; base += warps * kU) {
          const long long ahead = base + warps * kU + mine;
          const long long next_page = ahead < t1 ? page_of(env, indices, span.first_page, ahead, shift) : 0;
          const int valid = static_cast<int>(min(static_cast<long long>(kU), t1 - base));
          float kr[kU][kPer], vr[kU][kPer];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const long long pg = __shfl_sync(0xffffffffu, page, u);
            const T* row = head_base + pg * cache.stride[2] + ((base + u) & (page_size - 1)) * cache.stride[4];
            if (u < valid) {
              load_vec<kPer>(row, kr[u]);
              load_vec<kPer>(row + cache.stride[1], vr[u]);
            } else {
#pragma unroll
              for (int i = 0; i < kPer; ++i) kr[u][i] = vr[u][i] = 0.f;
            }
          }
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            float s[kU];
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              float d = 0.f;
#pragma unroll
              for (int i = 0; i < kPer; ++i) d += qr[g][i] * kr[u][i];
              s[u] = u < valid ? warp_sum(d) : -INFINITY;
              mx = fmaxf(mx, s[u]);
            }
            const float corr = exp2f(m[g] - mx);  // mx is finite: the step has a valid position
            l[g] *= corr;
#pragma unroll
            for (int i = 0; i < kPer; ++i) acc[g][i] *= corr;
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              if (u < valid) {
                const float p = exp2f(s[u] - mx);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < kPer; ++i) acc[g][i] += p * vr[u][i];
              }
            }
            m[g] = mx;
          }
          page = next_page;
        }
        // combine the warps' states in warp order (deterministic)
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          float* w = red + (warp * kG + g) * (D + 2);
          if (lane == 0) {
            w[0] = m[g];
            w[1] = l[g];
          }
#pragma unroll
          for (int i = 0; i < kPer; ++i) w[2 + lane * kPer + i] = acc[g][i];
        }
        __syncthreads();
        float* out = static_cast<float*>(env.buffers[c.out_buffer]) + ((b * KV + kvh) * C + ch) * kG * (D + 1);
        for (int e = threadIdx.x; e < kG * (D + 1); e += blockDim.x) {
          const int g = e / (D + 1), d = e % (D + 1);
          float mx = -INFINITY;
          for (int w = 0; w < warps; ++w) mx = fmaxf(mx, red[(w * kG + g) * (D + 2)]);
          float sum = 0.f, o = 0.f;
          if (mx != -INFINITY) {
            for (int w = 0; w < warps; ++w) {
              const float* s = red + (w * kG + g) * (D + 2);
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

// input states [B, KV, C, G, D+1]; output [B, H, D] of type T. One warp per (b, h); lane l
// holds dims l + 32·i. The chunks' states are loaded kBlock at a time (all in flight), then
// folded with ⊕ in chunk order.
template <int kPer, typename T>
__device__ __noinline__ void attn_merge_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int D = 32 * kPer, kBlock = 8;
  const ViewC& st = c.in[0];
  const int C = static_cast<int>(st.shape[2]), G = static_cast<int>(st.shape[3]);
  const int H = static_cast<int>(c.out_shape[1]);
  const int heads = static_cast<int>(r.hi[1] - r.lo[1]);
  const int rows = static_cast<int>(r.hi[0] - r.lo[0]) * heads;
  const int lane = threadIdx.x & 31;
  const float* states = static_cast<const float*>(env.buffers[st.buffer]) + st.offset;
  for (int job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long b = r.lo[0] + job / heads, h = r.lo[1] + job % heads;
    const float* first = states + ((b * st.shape[1] + h / G) * C * G + h % G) * (D + 1);
    float o[kPer], lse = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.f;
    for (int c0 = 0; c0 < C; c0 += kBlock) {
      float ob[kBlock][kPer], lb[kBlock];
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const float* s = first + static_cast<long long>(c0 + j) * G * (D + 1);
        lb[j] = c0 + j < C ? s[D] : -INFINITY;
#pragma unroll
        for (int i = 0; i < kPer; ++i) ob[j][i] = c0 + j < C ? s[lane + 32 * i] : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        float next = lse;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          next = lse;
          o[i] = merge_state(o[i], next, ob[j][i], lb[j]);
        }
        lse = next;
      }
    }
    T* out = static_cast<T*>(env.buffers[c.out_buffer]) + (b * H + h) * D;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = from_f<T>(o[i]);
  }
}

}  // namespace mpk

// Task family: attention. softmax(q·kᵀ·scale + mask)·v with GQA (query head h reads kv head
// h / (Hq/Hkv)) and torch's top-left causal mask; one warp per (b, h, s) query row with an
// online softmax in natural-log base; lanes split the head dim. The paged, split-KV version
// is a later milestone.
#pragma once
#include "common.cuh"

namespace mpk {

constexpr int kMaxHeadDim = 512;

// inputs q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv], optional mask; fparam[0] scale,
// iparam[0] causal.
__device__ void task_attention(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& q = c.in[0];
  const ViewC& k = c.in[1];
  const ViewC& v = c.in[2];
  const long long d = q.shape[3], dv = v.shape[3], sk = k.shape[2];
  const long long group = q.shape[1] / k.shape[1];
  const bool causal = c.iparam[0] != 0;
  constexpr int kPer = kMaxHeadDim / 32;
  const int lane = threadIdx.x & 31;
  const long long nrows = rect_numel(r, 3);
  for (long long row = threadIdx.x >> 5; row < nrows; row += blockDim.x >> 5) {
    long long idx[4];
    rect_unravel(r, 3, row, idx);
    const long long b = idx[0], h = idx[1], s = idx[2];
    float qv[kPer], acc[kPer];
    for (int i = 0; i < kPer; ++i) {
      const long long j = lane + 32LL * i;
      long long qi[4] = {b, h, s, j};
      qv[i] = j < d ? load_f(env.buffers[q.buffer], q.dtype, view_index(q, qi, 4)) : 0.f;
      acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const long long keys = causal ? (s + 1 < sk ? s + 1 : sk) : sk;
    for (long long t = 0; t < keys; ++t) {
      float part = 0.f;
      for (int i = 0; i < kPer; ++i) {
        const long long j = lane + 32LL * i;
        if (j < d) {
          long long ki[4] = {b, h / group, t, j};
          part += qv[i] * load_f(env.buffers[k.buffer], k.dtype, view_index(k, ki, 4));
        }
      }
      float score = warp_sum(part) * c.fparam[0];
      if (c.num_inputs > 3) {
        const ViewC& mk = c.in[3];
        long long mi[4] = {b, h, s, t};
        const long long off = view_index(mk, mi, 4);
        if (mk.dtype == kBool) score = load_i(env.buffers[mk.buffer], kBool, off) ? score : -INFINITY;
        else score += load_f(env.buffers[mk.buffer], mk.dtype, off);
      }
      if (score == -INFINITY) continue;
      const float m_new = fmaxf(m, score);
      const float corr = expf(m - m_new), p = expf(score - m_new);
      l = l * corr + p;
      for (int i = 0; i < kPer; ++i) {
        const long long j = lane + 32LL * i;
        long long vi[4] = {b, h / group, t, j};
        const float vv = j < dv ? load_f(env.buffers[v.buffer], v.dtype, view_index(v, vi, 4)) : 0.f;
        acc[i] = acc[i] * corr + p * vv;
      }
      m = m_new;
    }
    for (int i = 0; i < kPer; ++i) {
      const long long j = lane + 32LL * i;
      if (j < dv) {
        long long oi[4] = {b, h, s, j};
        // a row whose every key is masked (l == 0: any kept key adds at least 1) gives zeros, as
        // torch's SDPA does (a left-padded prompt's padding rows); a NaN score stays NaN
        store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(oi, c.out_shape, 4), l == 0.f ? 0.f : acc[i] / l);
      }
    }
  }
}

}  // namespace mpk

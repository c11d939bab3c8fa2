// Task family: attention over a paged KV cache (mpk/ops/paged.py documents the layout, the
// page table and the two forms, decode and ragged). ``rope_append``: qk-norm + RoPE of one
// token per sequence (kRagged: of each token row) and its k/v appended to the cache;
// ``attn_partial``: the (O, LSE) state of a kv head's G query heads over one KV chunk (kRagged:
// row by row; paged_prefill.cuh holds the ragged form's block-of-rows task, attn_prefill);
// ``rope_attn_partial``: the two in one task (attn_partial_impl with kRope, decode only);
// ``attn_merge``: ⊕ of a head's chunk states.
//
// LSE base 2 everywhere: lse = log2 Σ 2^s with s = q·k·scale·log2(e); O is normalised; the
// empty state is (O = 0, lse = −inf). attn_merge_impl below is the CUDA form of ⊕.
//
// The tasks are templates over the head dim (kPer = D / 32 elements per lane), the group size
// G, the element type T of q, the cache and the rope inputs, and the page table's integer type
// I; codegen instantiates only the combinations of its graph (mpk.ops.paged: the kinds'
// GpuSpec.task names the instantiation per op). Straight-line typed code
// keeps each task's instructions few: the persistent kernel holds every task family, and a
// task whose code is not in the instruction cache pays for fetching it.
#pragma once
#include "paged_table.cuh"

namespace mpk {

constexpr float kLog2e = 1.4426950408889634f;

// One warp's head row of qkv, lane l holding dims l + 32·i (so the rotate-half partner of a dim
// sits in the same lane): loaded, then qk-normed (with HF's roundings) and rotated by RoPE.
template <int kPer, typename T>
struct RopeRow {
  static constexpr int kHalf = kPer / 2, D = 32 * kPer;
  float x[kPer], w[kPer], cv[kPer], sv[kPer];

  // wn: the qk-norm weight (null: none); crow: the cos | sin row of the token's position (null:
  // no rotation)
  __device__ __forceinline__ void load_consts(const T* wn, const T* crow) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      w[i] = wn ? to_f(wn[lane + 32 * i]) : 1.f;
      const int f = lane + 32 * (i < kHalf ? i : i - kHalf);  // the frequency of dim lane + 32·i
      cv[i] = crow ? to_f(crow[f]) : 1.f;
      sv[i] = crow ? to_f(crow[f + D / 2]) : 0.f;
    }
  }
  __device__ __forceinline__ void load(const T* row) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = to_f(row[lane + 32 * i]);
  }
  __device__ __forceinline__ void rotate(bool norm, float eps) {
    if (norm) {  // normalise, round, scale, round
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) ss += x[i] * x[i];
      const float rstd = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
      for (int i = 0; i < kPer; ++i) x[i] = round_as<T>(round_as<T>(x[i] * rstd) * w[i]);
    }
    float y[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) y[i] = x[i] * cv[i] + (i < kHalf ? -x[i + kHalf] : x[i - kHalf]) * sv[i];
#pragma unroll
    for (int i = 0; i < kPer; ++i) x[i] = y[i];
  }
  __device__ __forceinline__ void store(T* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = from_f<T>(x[i]);
  }
};

// Where the token at position pos of kv head `head` goes in layer `layer` of the cache: k (kv 0) or v.
template <typename T>
__device__ __forceinline__ T* cache_slot(const TaskEnv& env, const ViewC& cache, long long layer, int kv, long long page,
                                         long long head, long long pos, int page_size) {
  return static_cast<T*>(env.buffers[cache.buffer]) + cache.offset + layer * cache.stride[0] + kv * cache.stride[1] +
         page * cache.stride[2] + head * cache.stride[3] + (pos & (page_size - 1)) * cache.stride[4];
}

// The position being decoded (len − 1) of sequence b as rope reads it, or −1 where the page
// table does not count the token (no grow before the step) or the position is past the cos/sin
// table: the caller skips the sequence (an append there would write outside its pages) and the
// first such row of the launch is reported (BadInputError after the launch), where a trap would
// leave the process's CUDA context unusable.
__device__ __forceinline__ long long rope_position(const SeqSpan& s, const ViewC& cs, int out_buffer, long long b) {
  const long long pos = s.len - 1;
  if (pos >= 0 && pos < cs.shape[0]) return pos;
  report_bad_input(kBadPosition, out_buffer, b, pos, cs.shape[0]);
  return -1;
}

// A ragged row's position as rope reads it, or −1 past the cos/sin table (reported, as
// rope_position does for decode).
__device__ __forceinline__ long long row_position(long long pos, const ViewC& cs, int out_buffer, long long t) {
  if (pos < cs.shape[0]) return pos;
  report_bad_input(kBadRowPosition, out_buffer, t, pos, cs.shape[0]);
  return -1;
}

// rope_append's ragged form (prefill, mixed steps): tiles of up to thousands of token rows by a
// head or a few, so the task must be bound by bandwidth, not by each row's latency.
// - Rows: the tile's rows fall into 8·⌈R / 256⌉ groups of equal size (at most 32 rows), warp w
//   taking groups w, w + 8, …; lane l resolves row l of the warp's group once, when the group's
//   first copies are issued (under the copies of the group before): ragged_row, row_position
//   and, where the tile appends k/v, the page at the row's position (a faulty row or page is
//   reported as decode reports it). The position and page (−1: a padding or faulty row, a page
//   outside the cache) stay in the lane's registers, read by shuffle.
// - Units: a group is a stream of head rows (D elements), row by row: the row's cos | sin row,
//   its q heads, then k and v of each kv head. A warp's eighth of the scratch area holds two
//   stages of kStage units: the warp copies a batch into one with 16-byte cp.async while it
//   computes the batch before from the other (kilobytes in flight per warp, no registers held
//   for them). Lane u works out unit u of a batch (what it is, where it is read and written)
//   once for its copies and its computation.
// - Compute: a head as decode computes it (RopeRow, from shared memory: the same roundings and
//   reduction order, so bit for bit the same results), with the cos/sin of the row's cos | sin
//   unit (in registers for its heads) and the norm weights loaded once a task. A padding row
//   (or one whose position is not followed) gets a zero q and appends nothing; a bad page skips
//   the row's k/v.
template <int kPer, typename T, typename I>
__device__ __forceinline__ void rope_append_rows(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int D = 32 * kPer, kHalf = kPer / 2, kVec = 16 / static_cast<int>(sizeof(T)), kPieces = D / kVec;
  constexpr int kWarps = kThreadsPerTask / 32;
  constexpr int kStage = static_cast<int>(kScratchFloats * sizeof(float) / (2 * kWarps * D * sizeof(T)));
  constexpr int kRounds = (kStage * kPieces + 31) / 32;  // a stage's copies over the warp's lanes
  static_assert(kStage >= 1 && kStage <= 32, "a lane works out each unit of a stage");
  enum : int { kSkip, kCosSin, kQ, kK, kV, kZero };  // what a unit is (kZero: a padding row's q)
  const ViewC &qkv = c.in[0], &cs = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4],
              &cache = c.in[5];
  const bool qk_norm = c.iparam[4] != 0;
  const float eps = c.fparam[0];
  const ViewC& qo = c.in[qk_norm ? 8 : 6];
  const int H = static_cast<int>(c.iparam[0]), KV = static_cast<int>(c.iparam[1]);
  const int page_size = static_cast<int>(c.iparam[3]), shift = log2_pow2(page_size);
  const int group = H / KV, h0 = static_cast<int>(r.lo[1]), nq = static_cast<int>(r.hi[1]) - h0;
  const int kv0 = (h0 + group - 1) / group, nkv = (h0 + nq + group - 1) / group - kv0;
  const int per_row = 1 + nq + 2 * nkv;  // units a row
  if (!qo_ok<I>(env, qo, c.out_shape[0], c.out_buffer)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = static_cast<int>(r.hi[0] - r.lo[0]);
  if (R <= 0) return;  // no rows (partitioning makes no such tile)
  const int groups = kWarps * ((R + kWarps * 32 - 1) / (kWarps * 32));
  const int g = (R + groups - 1) / groups, ng = (R + g - 1) / g;  // rows a group, groups
  float wq[kPer], wk[kPer];
  {
    const ViewC &qn = c.in[6], &kn = c.in[7];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      wq[i] = qk_norm ? to_f(static_cast<const T*>(env.buffers[qn.buffer])[qn.offset + lane + 32 * i]) : 1.f;
      wk[i] = qk_norm && nkv > 0 ? to_f(static_cast<const T*>(env.buffers[kn.buffer])[kn.offset + lane + 32 * i]) : 1.f;
    }
  }
  const T* const rows_in = static_cast<const T*>(env.buffers[qkv.buffer]) + qkv.offset;
  const T* const cs_in = static_cast<const T*>(env.buffers[cs.buffer]) + cs.offset;
  T* const q_out = static_cast<T*>(env.buffers[c.out_buffer]);
  T* const stages = reinterpret_cast<T*>(scratch()) + warp * 2 * kStage * D;

  int k = warp, v = 0;      // the next batch: group k's units from v on
  int pos = -1, page = -1;  // lane l: row l of group k (resolve)
  const auto resolve = [&] {
    pos = page = -1;
    const long long t = r.lo[0] + static_cast<long long>(k) * g + lane;
    if (lane >= min(g, R - k * g)) return;
    const RaggedRow row = ragged_row<I>(env, indptr, indices, last, qo, t, page_size, c.out_buffer);
    const long long p = row.pos >= 0 ? row_position(row.pos, cs, c.out_buffer, t) : -1;
    if (p < 0) return;
    pos = static_cast<int>(p);
    if (nkv == 0) return;
    const SeqPages<I> pages(env, indices, row.span.first_page, shift);
    const long long pg = pages(p);
    if (page_ok(pg, cache.shape[2]))
      page = static_cast<int>(pg);
    else
      report_bad_page(pages, row.span.first_page, row.span.len, cache.shape[2], c.out_buffer);
  };
  // a stage's unit count, and lane u's unit's kind and destination (two named sets: an array
  // indexed by the stage would live in local memory)
  int n0 = 0, n1 = 0, kind0 = kSkip, kind1 = kSkip;
  unsigned long long dst0 = 0, dst1 = 0;
  // copies the batch at (k, v) into stage s, then moves (k, v) on
  const auto issue = [&](int s) {
    if (v == 0) resolve();
    const int units = min(g, R - k * g) * per_row, n = min(kStage, units - v);
    const int u = v + lane, row = u / per_row, j = u - row * per_row - 1;  // j: −1 cos|sin, then the heads
    const int p = __shfl_sync(0xffffffffu, pos, row & 31), pg = __shfl_sync(0xffffffffu, page, row & 31);
    const long long t = r.lo[0] + static_cast<long long>(k) * g + row;
    int kind = kSkip;
    const T* src = nullptr;
    T* dst = nullptr;
    if (lane < n) {
      if (j < 0) {
        if (p >= 0) {
          kind = kCosSin;
          src = cs_in + p * cs.stride[0];
        }
      } else if (j < nq) {
        kind = p >= 0 ? kQ : kZero;
        src = p >= 0 ? rows_in + t * qkv.stride[0] + static_cast<long long>(h0 + j) * D : nullptr;
        dst = q_out + (t * H + h0 + j) * D;
      } else if (pg >= 0) {  // k, then v, of kv head kv0 + jj / 2
        const int jj = j - nq, kv = jj & 1, head = kv0 + (jj >> 1);
        kind = kv ? kV : kK;
        src = rows_in + t * qkv.stride[0] + static_cast<long long>(H + kv * KV + head) * D;
        dst = cache_slot<T>(env, cache, c.iparam[5], kv, pg, head, p, page_size);
      }
    }
    T* const stage = stages + s * kStage * D;
    const auto from = reinterpret_cast<unsigned long long>(src);
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int piece = lane + 32 * i, at = piece / kPieces, e = piece % kPieces;
      const T* const a = reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, from, at & 31));
      if (at < n && a != nullptr) cp_async16(stage + at * D + e * kVec, a + e * kVec);
    }
    cp_async_commit();
    (s ? n1 : n0) = n;
    (s ? kind1 : kind0) = kind;
    (s ? dst1 : dst0) = reinterpret_cast<unsigned long long>(dst);
    v += n;
    if (v == units) {
      v = 0;
      k += kWarps;
    }
  };
  float ch[kHalf], sh[kHalf];  // the cos and sin of the row being computed at lane l's frequencies l + 32·i
  const auto compute = [&](int s) {
    const T* const stage = stages + s * kStage * D;
    const int n = s ? n1 : n0, kinds = s ? kind1 : kind0;
    const unsigned long long dsts = s ? dst1 : dst0;
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
      const int kind = __shfl_sync(0xffffffffu, kinds, i);
      const T* const unit = stage + i * D;
      T* const dst = reinterpret_cast<T*>(__shfl_sync(0xffffffffu, dsts, i));
      if (kind == kCosSin) {
#pragma unroll
        for (int e = 0; e < kHalf; ++e) {
          ch[e] = to_f(unit[lane + 32 * e]);
          sh[e] = to_f(unit[lane + 32 * e + D / 2]);
        }
      } else if (kind != kSkip) {
        RopeRow<kPer, T> x;
        if (kind == kZero) {
#pragma unroll
          for (int e = 0; e < kPer; ++e) x.x[e] = 0.f;
        } else {
          x.load(unit);
        }
        if (kind == kQ || kind == kK) {
#pragma unroll
          for (int e = 0; e < kPer; ++e) {
            x.w[e] = kind == kQ ? wq[e] : wk[e];
            x.cv[e] = ch[e % kHalf];
            x.sv[e] = sh[e % kHalf];
          }
          x.rotate(qk_norm, eps);
        }
        x.store(dst);
      }
    }
  };
  // issue a batch, then compute the one before it (in the other stage) under its copies
  for (int s = 0, pending = 0;; s ^= 1, pending = 1) {
    const bool more = k < ng;
    if (more) issue(s);
    if (pending) {
      if (more)
        cp_async_wait_pending<1>();
      else
        cp_async_wait_pending<0>();
      __syncwarp();
      compute(s ^ 1);
      __syncwarp();  // the stage is copied into next
    }
    if (!more) break;
  }
  __syncthreads();  // the next task may use the scratch area
}

// inputs: qkv [T, (H+2KV)·D], cos_sin [P, D] (cos | sin), kv_indptr, kv_indices,
// kv_last_page_len, kv_cache, q_norm [D], k_norm [D] (when iparam[4]), then qo_indptr
// (kRagged); output q [T, H, D]. iparam: heads, kv_heads, head_dim, page_size, qk_norm, layer;
// fparam[0] eps. A tile covers rows [r.lo[0], r.hi[0]) and query heads [h0, h1) and appends
// the k/v of the kv heads whose group starts in it (mpk/ops/paged.py: kv_heads_of_tile).
// Decode (row b is sequence b at its last position): one warp per (row, head); lane l holds
// dims l + 32·i, so the rotate-half partner of a dim sits in the same lane. Two round trips:
// the page-table entries, then the row, the norm weight, cos/sin and the page at the token's
// position together — the shortest path for the tiny tiles of small batches.
// kRagged: rope_append_rows.
template <int kPer, typename T, typename I, bool kRagged = false>
__device__ __noinline__ void rope_append_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  if constexpr (kRagged) {
    rope_append_rows<kPer, T, I>(c, r, env);
  } else {
    constexpr int D = 32 * kPer;
    const ViewC &qkv = c.in[0], &cs = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4],
                &cache = c.in[5];
    const int H = static_cast<int>(c.iparam[0]), KV = static_cast<int>(c.iparam[1]);
    const int page_size = static_cast<int>(c.iparam[3]), shift = log2_pow2(page_size);
    const bool qk_norm = c.iparam[4] != 0;
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
      const SeqSpan s = seq_span<I>(env, indptr, indices, last, b, page_size, c.out_buffer);
      const long long pos = rope_position(s, cs, c.out_buffer, b);
      if (pos < 0) continue;
      RopeRow<kPer, T> x;
      x.load_consts(wn, rotate ? static_cast<const T*>(env.buffers[cs.buffer]) + cs.offset + pos * cs.stride[0] : nullptr);
      x.load(row);
      const long long page = head >= H ? page_of<I>(env, indices, s.first_page, pos, shift) : 0;
      if (!page_ok(page, cache.shape[2])) {
        report_bad_page(SeqPages<I>(env, indices, s.first_page, shift), s.first_page, s.len, cache.shape[2],
                        c.out_buffer);
        continue;
      }
      if (rotate) x.rotate(norm, c.fparam[0]);
      const int kv = head < H + KV ? 0 : 1;
      x.store(head < H ? static_cast<T*>(env.buffers[c.out_buffer]) + (b * H + head) * static_cast<long long>(D)
                       : cache_slot<T>(env, cache, c.iparam[5], kv, page, head - H - kv * KV, pos, page_size));
    }
  }
}

// rope_attn_partial's rotated rows (static shared memory of the kRope instantiations only)
template <typename T, int kN>
__device__ __forceinline__ T* rope_rows_smem() {
  __shared__ __align__(16) T s[kN];
  return s;
}

// Positions a warp copies per step: its K slot and its V slot hold 2 KiB each (rows of 32·kPer T).
template <int kPer, typename T>
constexpr int kAttnStep = 2048 / (32 * kPer * static_cast<int>(sizeof(T)));

// A warp's online-softmax states of a kv head's G query heads over the positions it attends to
// (LSE base 2: scores are q·k·scale with scale = softmax scale · log2(e)). Two forms, one
// interface — load_q (row g of q at q0 + g·hs), start, step (the first `valid` rows of a step's
// K and V), store (each head's m, l = Σ 2^(s − m) and unnormalised O into [G][D + 2] floats):
// HeadStates on the CUDA cores, lane l holding dims l + 32·i of every head; MmaHeadStates on the
// tensor cores for 16-bit caches (AttnStates picks).
template <int kPer, int kG, typename T>
struct HeadStates {
  static constexpr int D = 32 * kPer;
  static constexpr bool kSwizzled = false;  // the K/V slot rows as copied
  float q[kG][kPer], acc[kG][kPer], m[kG], l[kG];

  __device__ __forceinline__ void load_q(const T* q0, long long hs) {
#pragma unroll
    for (int g = 0; g < kG; ++g) load_vec<kPer>(q0 + g * hs + (threadIdx.x & 31) * kPer, q[g]);
  }
  __device__ __forceinline__ void start(float scale) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        q[g][i] *= scale;
        acc[g][i] = 0.f;
      }
    }
  }
  // two positions at a time (attend), not unrolled further: short code
  __device__ __forceinline__ void step(const T* k, const T* v, int valid) {
    int u = 0;
#pragma unroll 1
    for (; u + 1 < valid; u += 2) attend<2>(k + u * D, v + u * D);
#pragma unroll 1
    for (; u < valid; ++u) attend<1>(k + u * D, v + u * D);
  }
  // kN consecutive positions (K rows at k, V rows at v, D elements apart) into every head's
  // state: their scores' warp reductions are independent, so two positions cost about the
  // latency of one
  template <int kN>
  __device__ __forceinline__ void attend(const T* k, const T* v) {
    const int lane = threadIdx.x & 31;
    float kf[kN][kPer], vf[kN][kPer];
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      load_vec<kPer>(k + n * D + lane * kPer, kf[n]);
      load_vec<kPer>(v + n * D + lane * kPer, vf[n]);
    }
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      float s[kN], m_new = m[g];
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) d += q[g][i] * kf[n][i];
        s[n] = warp_sum(d);
        m_new = fmaxf(m_new, s[n]);
      }
      const float corr = exp2f(m[g] - m_new);
      float p[kN], psum = 0.f;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        p[n] = exp2f(s[n] - m_new);
        psum += p[n];
      }
      l[g] = l[g] * corr + psum;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        float a = acc[g][i] * corr;
#pragma unroll
        for (int n = 0; n < kN; ++n) a += p[n] * vf[n][i];
        acc[g][i] = a;
      }
      m[g] = m_new;
    }
  }
  __device__ __forceinline__ void store(float* w) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      if (lane == 0) {
        w[g * (D + 2)] = m[g];
        w[g * (D + 2) + 1] = l[g];
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) w[g * (D + 2) + 2 + lane * kPer + i] = acc[g][i];
    }
  }
};

// The tensor-core form, for G ≤ 8 heads of D ≤ 128 in bf16 or f16. Per step, S = Q·Kᵀ takes
// the heads as the MMA's rows (G of 16 used) and 8 positions as its columns; its accumulator
// fragment, exponentiated and rounded to T, is already the B operand of Oᵀ += Vᵀ·Pᵀ (FlashAttention-
// 2's register reuse, with O transposed so that the 16-row side holds dims, not the few heads),
// so P never leaves registers. Lane (g, t) holds head g's scores at positions 2t, 2t + 1 of each
// 8, and Oᵀ at dims 16j + g (+ 8) of heads 2t, 2t + 1. K and V come from the slot by ldmatrix;
// the slot's rows are XOR-swizzled by 16-byte piece (kSwizzled: the copies place piece p of row
// u at p ^ (u % 8)) so a matrix's 8 rows hit distinct banks. P is rounded to T before its
// product with V (as FlashAttention does); Σ P stays in fp32.
template <int kPer, int kG, typename T>
struct MmaHeadStates {
  static constexpr int D = 32 * kPer, kU = kAttnStep<kPer, T>, kBlocks = kU / 8;
  static constexpr bool kSwizzled = true;
  static_assert(kG <= 8 && (D == 64 || D == 128) && sizeof(T) == 2, "MmaHeadStates: G ≤ 8, D 64 or 128, 16-bit T");
  uint32_t qa[D / 16][2];  // Q's A fragments per 16 dims: row g at dims 2t (+1) and 2t + 8 (+9); rows ≥ 8 are 0
  float o[D / 16][4];      // Oᵀ: (dim 16j + g, heads 2t, 2t + 1), (dim 16j + g + 8, heads 2t, 2t + 1)
  float m, l, scale;       // head g's running max; this lane's share of its Σ p

  __device__ __forceinline__ void load_q(const T* q0, long long hs) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        qa[j][h] = g < kG ? *reinterpret_cast<const uint32_t*>(q0 + g * hs + 16 * j + 8 * h + 2 * t) : 0u;
  }
  __device__ __forceinline__ void start(float s) {
    scale = s;
    m = -INFINITY;
    l = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  }
  // Row u's piece p of a slot (k or v: kU rows of D), swizzled; rows past `valid` read row 0
  // (finite data: their scores are masked and their weights 0, and 0 · finite = 0).
  __device__ __forceinline__ static const T* piece(const T* rows, int u, int p, int valid) {
    u = u < valid ? u : 0;
    return rows + u * D + ((p ^ (u & 7)) << 3);
  }
  __device__ __forceinline__ void step(const T* k, const T* v, int valid) {
    const int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, r = lane & 7;
    float s[kBlocks][4];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      s[b][0] = s[b][1] = s[b][2] = s[b][3] = 0.f;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // two 16-dim k steps per ldmatrix: pieces 4j + mi
        uint32_t kb[4];
        ldmatrix_x4<false>(kb, piece(k, 8 * b + r, 4 * j + mi, valid));
        mma16816<T>(s[b], qa[2 * j][0], 0u, qa[2 * j][1], 0u, kb[0], kb[1]);
        mma16816<T>(s[b], qa[2 * j + 1][0], 0u, qa[2 * j + 1][1], 0u, kb[2], kb[3]);
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[b][e] = 8 * b + 2 * t + e < valid ? s[b][e] * scale : -INFINITY;
        mx = fmaxf(mx, s[b][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: position 0 of a step is valid
    const float corr = exp2f(m - m_new);
    float psum = 0.f;
    uint32_t pb[2] = {0u, 0u};  // Pᵀ's B fragment: positions 2t (+1), then 8 + 2t (+1)
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      const float p0 = exp2f(s[b][0] - m_new), p1 = exp2f(s[b][1] - m_new);
      psum += p0 + p1;
      pb[b] = pack2<T>(p0, p1);
    }
    l = l * corr + psum;
    m = m_new;
    // Oᵀ's columns are heads 2t and 2t + 1, whose factors lanes 8t and 8t + 4 hold
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t), c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c1;
      o[j][2] *= c0;
      o[j][3] *= c1;
      uint32_t va[4];  // Vᵀ's A fragment: matrices (positions 0–7 | 8–15) × (dims 16j | 16j + 8)
      ldmatrix_x4<true>(va, piece(v, 8 * (mi >> 1) + r, 2 * j + (mi & 1), valid));
      mma16816<T>(o[j], va[0], va[1], va[2], va[3], pb[0], pb[1]);
    }
  }
  __device__ __forceinline__ void store(float* w) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float sum = l + __shfl_xor_sync(0xffffffffu, l, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (t == 0 && g < kG) {
      w[g * (D + 2)] = m;
      w[g * (D + 2) + 1] = sum;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = 2 * t + h;
      if (head < kG) {
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          w[head * (D + 2) + 2 + 16 * j + g] = o[j][h];
          w[head * (D + 2) + 2 + 16 * j + g + 8] = o[j][2 + h];
        }
      }
    }
  }
};

// 16-bit K/V with a small group take the tensor-core states; the rest the CUDA-core ones.
template <int kPer, int kG, typename T>
using AttnStates = std::conditional_t<sizeof(T) == 2 && kG <= 8 && kPer <= 4, MmaHeadStates<kPer, kG, T>,
                                      HeadStates<kPer, kG, T>>;

// Which positions chunk ch of C reads from the cache, and how the warps split them: the
// sequence's cache positions (under kRope all but the token being decoded, which the last
// chunk's tile attends to from shared memory) in as many balanced chunks as make no chunk
// shorter than kMinChunk positions, at most C — the grid is static, the length is not, and a
// short sequence in many chunks paid their tasks for nothing (mpk.ops.paged.chunk_bounds is
// the Python form); chunks past those are empty. t1: the end; ku per warp step (kU, or fewer
// when the chunk is short, so all warps get some); base this warp's first position. The
// task's warp count is a constant (kAttnWarps): divisions by it are shifts, and the combine's
// loops over the warps unroll.
constexpr int kAttnWarps = kThreadsPerTask / 32;
constexpr long long kMinChunk = 128;  // mpk.ops.paged.MIN_CHUNK
struct ChunkSplit {
  long long t1, base;
  int ku;
};
__device__ __forceinline__ ChunkSplit split_chunk(const SeqSpan& s, long long ch, int C, bool rope, int kU) {
  constexpr int warps = kAttnWarps;
  const long long m = max(0LL, s.len - (rope ? 1 : 0));
  const long long used = min(static_cast<long long>(C), max(1LL, m / kMinChunk));
  const long long t0 = ch < used ? ch * m / used : m;
  ChunkSplit k;
  k.t1 = ch < used ? (ch + 1) * m / used : m;
  k.ku = static_cast<int>(min(static_cast<long long>(kU), max(1LL, (k.t1 - t0 + warps - 1) / warps)));
  k.base = t0 + (threadIdx.x >> 5) * k.ku;
  return k;
}

// The ragged form's chunk (mpk.ops.paged: _ragged_partial_cpu): chunk ch of C of a sequence's
// first m positions (m: the position of its segment's last row in the tile, + 1), cut at the
// row's own limit lim (its position + 1; 0: a padding row), split over the warps as split_chunk.
__device__ __forceinline__ ChunkSplit split_rows_chunk(long long m, long long lim, long long ch, int C, int kU) {
  constexpr int warps = kAttnWarps;
  const long long used = min(static_cast<long long>(C), max(1LL, m / kMinChunk));
  const long long t0 = ch < used ? ch * m / used : m;
  ChunkSplit k;
  k.t1 = max(t0, min(lim, ch < used ? (ch + 1) * m / used : m));
  k.ku = static_cast<int>(min(static_cast<long long>(kU), max(1LL, (k.t1 - t0 + warps - 1) / warps)));
  k.base = t0 + (threadIdx.x >> 5) * k.ku;
  return k;
}

// What attn_partial reads before its gate, for the tile's first sequence and chunk: the page
// table is a graph input no task writes.
struct AttnStart {
  SeqSpan span;
  long long page;      // the page of this lane's position (lane % ku) in its warp's first step
  long long new_page;  // kRope, warps G and G + 1: the page the new token's k / v go to
};
// kRagged: and the first row's chunking length m and limit lim (split_rows_chunk)
struct RaggedStart : AttnStart {
  long long m, lim;
};
template <bool kRagged>
using AttnStartOf = std::conditional_t<kRagged, RaggedStart, AttnStart>;

// Where a ragged tile's work comes from and its states go (the balanced split, attn_plan in
// paged_plan.cuh; identity without a plan): its rect names the rows and chunk it attends, whose
// positions split into `splits` chunks of a segment ending at or before tile_end; row t's state
// of chunk ch is stored at row t + row_shift, slot ch + slot_shift.
struct TileMap {
  long long row_shift, slot_shift, splits, tile_end;
};

// m and lim of a ragged row in a tile whose rows end at tile_end (split_rows_chunk).
__device__ __forceinline__ void ragged_extent(const RaggedRow& row, long long tile_end, long long& m, long long& lim) {
  lim = row.pos + 1;
  m = row.pos < 0 ? 0 : row.span.len - max(0LL, row.rows_end - tile_end);
}

// attn_partial — inputs: q [B, H, D], kv_cache, kv_indptr, kv_indices, kv_last_page_len;
// iparam: layer, page_size; fparam[0] scale. kRope (rope_attn_partial) — rope_append's inputs
// (qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache[, q_norm, k_norm]); iparam
// adds heads, kv_heads, qk_norm; fparam[1] eps: warps 0…G−1 rotate the group's q heads
// into shared memory and, in the last chunk's tile, warps G and G+1 rotate k and take v of the
// token being decoded, write both to the cache and keep them in shared memory, where warp 0
// attends to that position after its loop (the other positions of the chunk come from the
// cache as usual; no tile reads the slot just written). Output states [B, KV, C, G, D+1] fp32.
// Each warp runs an online softmax over its share of the chunk for all G query heads (a K/V
// row is read once per warp and used by every head); the warps' states are then combined in a
// fixed order through shared memory. A warp takes kU consecutive positions per step (fewer
// when the chunk is short, so that every warp has some): their K and V rows (4 KB) are
// copied into its shared-memory slot with cp.async, all in flight at once — with a second
// slot (long chunks) while it attends to the step in the other; the page-table entries of the
// step a slot takes next are loaded during the current one (the first steps' copies go out
// before kRope's rotations, under their loads).
// kRagged (the ragged form, mpk.ops.paged; no kRope): the tile's rows are token rows, each
// attended on its own as above over its chunk of its segment (split_rows_chunk); output
// states [T, KV, C, G, D+1] (kFinal [T, KV, G, D]); a padding row gets the empty state.
// attn_prefill (paged_prefill.cuh) is the ragged form's block-of-rows task on the tensor
// cores; this one takes what it does not (fp32, head dim 256, groups over 16, one-row tiles).
// A warp's states are AttnStates: on the tensor cores for 16-bit caches. (The first step's
// copies are not issued before the task's gate, into the wait for the qkv projection: that made
// large-batch steps slower.) kSlot: the phase timer's slot.
// kFinal (one chunk per sequence): the output is O itself, [B, KV, G, D] of T — attn_merge's
// result for a single state (its weight is 2^0 = 1), so no merge op follows.
template <int kPer, int kG, typename T, typename I, bool kRope, bool kFinal, bool kRagged = false,
          int kSlot = kAttnPhaseSlot>
__device__ __noinline__ void attn_partial_impl(const OpC& c, const Rect& r, const TaskEnv& env,
                                               const AttnStartOf<kRagged>& first, const TileMap& map) {
  constexpr int D = 32 * kPer;
  constexpr int kRowBytes = D * static_cast<int>(sizeof(T)), kU = kAttnStep<kPer, T>, kPieces = kRowBytes / 16;
  static_assert(2 * kU * kPieces == 256, "a step's copies are 8 rounds of the warp's 32 lanes");
  static_assert(!kRope || kG + 2 <= 8, "a warp per q head, k and v (the runtime runs 8 warps per task)");
  using St = AttnStates<kPer, kG, T>;
  const ViewC &q = c.in[0], &cache = c.in[kRope ? 5 : 1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4];
  const int KV = static_cast<int>(c.out_shape[1]), C = kFinal ? 1 : static_cast<int>(c.out_shape[2]);
  const int page_size = static_cast<int>(c.iparam[1]), shift = log2_pow2(page_size);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int warps = kAttnWarps;
  // phases (MPK_PHASES, slot kSlot): 0 the first K/V copies issued (the page table of
  // the tile's first sequence was read before the gate: attn_partial), 1 kRope's rotations, 4
  // the wait for the first step's K/V, 2 the rest of the position loop, 3 the warps' states
  // combined and stored
  PhaseTimer phase(kSlot);
  float* red = scratch();  // during the loop: each warp's K/V slot [2][kU][D] of T; then [warps][kG][D + 2]
  // A warp's K/V slots: one in the scratch area and, where the launch reserved it (the host
  // does where a warp's share of a chunk runs to many steps: mpk.ops.paged.ATTN_SECOND_SLOT_MIN_STEPS),
  // a second in dynamic shared memory, so that a step's copies are in flight while the warp
  // attends to the step before
  constexpr unsigned kSlotBytes = kAttnWarps * 2 * kU * D * sizeof(T);
  // (two named pointers: an array indexed by the step would live in local memory)
  T* const slot0 = reinterpret_cast<T*>(red) + warp * 2 * kU * D;
  T* const slot1 = reinterpret_cast<T*>(norm_tile()) + warp * 2 * kU * D;
  const int ahead_steps = dynamic_smem_size() >= kSlotBytes ? 2 : 1;
  // the cache's page count, page and row strides, held in registers across the loop's asm
  // memory clobbers
  const long long num_pages = cache.shape[2], page_stride = cache.stride[2], row_stride = cache.stride[4];
  // after the slots: each warp's table of its step's row offsets (issue, below)
  static_assert(kAttnWarps * 2 * kU * D * sizeof(T) + kAttnWarps * kU * sizeof(long long) <= kScratchFloats * sizeof(float),
                "the K/V slots and row tables fit the scratch area");
  long long* rows_at = reinterpret_cast<long long*>(reinterpret_cast<T*>(red) + kAttnWarps * 2 * kU * D) + warp * kU;
  const T* kvbase = static_cast<const T*>(env.buffers[cache.buffer]) + cache.offset + c.iparam[0] * cache.stride[0];
  // q rows: in global memory, or (kRope) [kG + 2][D] in shared memory: the rotated q heads,
  // then the new token's k and v
  const T* qbase = kRope ? nullptr : static_cast<const T*>(env.buffers[q.buffer]) + q.offset;
  T* rope_rows = nullptr;
  if constexpr (kRope) rope_rows = rope_rows_smem<T, (kG + 2) * D>();
  const long long ch0 = kFinal ? 0 : r.lo[2];
  for (long long b = r.lo[0]; b < r.hi[0]; ++b) {
    const bool at_first = b == r.lo[0];  // the sequence whose page table attn_partial read before the gate
    long long m = 0, lim = 0;  // kRagged: the row's chunking length and limit
    const SeqSpan span = [&] {
      if constexpr (kRagged) {
        if (at_first) {
          m = first.m;
          lim = first.lim;
          return first.span;
        }
        const RaggedRow row = ragged_row<I>(env, indptr, indices, last, c.in[5], b, page_size, c.out_buffer);
        ragged_extent(row, map.tile_end, m, lim);
        return row.span;
      } else {
        return at_first ? first.span : next_span<I>(env, indptr, indices, last, b, page_size, c.out_buffer);
      }
    }();
    const SeqPages<I> pages(env, indices, span.first_page, shift);
    for (long long kvh = r.lo[1]; kvh < r.hi[1]; ++kvh) {
      const T* head_base = kvbase + kvh * cache.stride[3];
      const long long v_at = cache.stride[1];
      for (long long ch = ch0; ch < (kFinal ? 1 : r.hi[2]); ++ch) {
        const bool fresh = kRope && ch == C - 1;  // this tile appends the new token and attends to it
        const ChunkSplit k = kRagged ? split_rows_chunk(m, lim, ch, map.splits, kU) : split_chunk(span, ch, C, kRope, kU);
        const long long t1 = k.t1;
        const int ku = k.ku, stride = warps * ku;
        long long base = k.base;
        const int mine = lane % ku;  // the position of the step whose page this lane looks up
        bool bad_page = false;       // this lane met a page outside the cache
        // the page of the step at ``at``'s position `mine`, clamped to the chunk (a step past it is
        // not issued, one running past it skips those rows): an unconditional load, whose value
        // nothing reads until the step is issued
        const auto lookup = [&](long long at) { return pages(min(at + mine, t1 - 1)); };
        const long long page = at_first && ch == ch0 ? first.page : base < t1 ? static_cast<long long>(lookup(base)) : 0;
        // the K and V rows of the step at ``at`` into `slot`, one cp.async group; pg: lane u's page
        // is position at + u's
        const auto issue = [&](long long at, long long pg, T* slot) {
          const int valid = static_cast<int>(min(static_cast<long long>(ku), t1 - at));
          // lane u < ku publishes where position at + u's K row starts in the layer's cache (its V
          // row is stride[1] further) in the warp's table, and each copy reads its row's from there:
          // one 64-bit multiply a row, not one a copy. A page outside the cache is read as page 0
          // (nothing out of bounds) and reported after the loop: the launch's outputs are not valid.
          __syncwarp();  // the last step's readers are done
          if (lane < ku) {
            const bool ok = page_ok(pg, num_pages);
            bad_page |= !ok;
            rows_at[lane] = (ok ? pg : 0) * page_stride + ((at + lane) & (page_size - 1)) * row_stride;
          }
          __syncwarp();
          // K rows, then V rows: the lanes take the kU·kPieces pieces of each in rounds (rows
          // past `valid` skipped), a piece's row and place shifts of its index: no 64-bit
          // multiply or division per piece, which would dominate a long loop's instructions. Two
          // rounds unrolled: more would lengthen the code that short-context steps fetch cold
          // each layer.
#pragma unroll
          for (int kv = 0; kv < 2; ++kv) {
            const T* rows = head_base + kv * v_at;
            T* dst = slot + kv * kU * D;
#pragma unroll 2
            for (int i = lane; i < kU * kPieces; i += 32) {
              const int u = static_cast<unsigned>(i) / kPieces, p = static_cast<unsigned>(i) % kPieces;
              const int piece = St::kSwizzled ? p ^ (u & 7) : p;
              if (u < valid) cp_async16(dst + u * D + piece * (16 / sizeof(T)), rows + rows_at[u] + p * (16 / sizeof(T)));
            }
          }
          cp_async_commit();
        };
        // the first step's copies, and with two slots the second's (one call site: less code)
#pragma unroll 1
        for (int j = 0; j < ahead_steps && base + j * stride < t1; ++j) {
          const long long at = base + j * stride;
          issue(at, j == 0 ? page : static_cast<long long>(lookup(at)), j == 0 ? slot0 : slot1);
        }
        phase.mark(0);
        St st;
        if constexpr (kRope) {
          const int H = static_cast<int>(c.iparam[2]), KVh = static_cast<int>(c.iparam[3]);
          const bool rows = warp < kG + (fresh ? 2 : 0);  // this warp rotates a q head, or takes k or v
          const int head = warp < kG ? static_cast<int>(kvh) * kG + warp : H + (warp - kG) * KVh + static_cast<int>(kvh);
          const bool rotate = warp <= kG, norm = c.iparam[4] != 0 && rotate;
          const long long pos = rows ? rope_position(span, c.in[1], c.out_buffer, b) : -1;
          if (pos >= 0) {
            const long long new_page = warp < kG ? 0 : at_first ? first.new_page : static_cast<long long>(pages(pos));
            const ViewC &wnv = c.in[warp < kG ? 6 : 7], &cs = c.in[1];
            const T* crow = static_cast<const T*>(env.buffers[cs.buffer]) + cs.offset + pos * cs.stride[0];
            RopeRow<kPer, T> x;
            x.load_consts(norm ? static_cast<const T*>(env.buffers[wnv.buffer]) + wnv.offset : nullptr,
                          rotate ? crow : nullptr);
            x.load(static_cast<const T*>(env.buffers[q.buffer]) + q.offset + b * q.stride[0] +
                   static_cast<long long>(head) * D);
            if (rotate) x.rotate(norm, c.fparam[1]);
            x.store(rope_rows + warp * D);
            if (warp >= kG) {
              if (page_ok(new_page, num_pages))
                x.store(cache_slot<T>(env, cache, c.iparam[0], warp - kG, new_page, kvh, pos, page_size));
              else
                bad_page = true;
            }
          }
          __syncthreads();
        }
        if constexpr (kRope) {
          st.load_q(rope_rows, D);
        } else {
          st.load_q(qbase + b * q.stride[0] + kvh * kG * q.stride[1], q.stride[1]);
        }
        st.start(c.fparam[0] * kLog2e);
        phase.mark(1);
        for (int s = 0; base < t1; base += stride, s ^= ahead_steps - 1) {
          T* slot = s ? slot1 : slot0;
          const long long next = base + ahead_steps * stride;  // the step this slot takes next
          const I next_page = lookup(next);
          const int valid = static_cast<int>(min(static_cast<long long>(ku), t1 - base));
          if (ahead_steps == 2 && base + stride < t1)
            cp_async_wait_pending<1>();  // this step's group, not the next one's
          else
            cp_async_wait_pending<0>();
          __syncwarp();
          if (base == k.base) phase.mark(4);
          st.step(slot, slot + kU * D, valid);
          __syncwarp();  // the slot is refilled
          if (next < t1) issue(next, next_page, slot);
        }
        // (one row: the same in a swizzled slot's layout)
        if (fresh && warp == 0) st.step(rope_rows + kG * D, rope_rows + (kG + 1) * D, 1);
        if (bad_page) report_bad_page(pages, span.first_page, span.len, num_pages, c.out_buffer);
        __syncthreads();  // the states below overwrite the warps' K/V slots
        phase.mark(2);
        // combine the warps' states in warp order (deterministic)
        st.store(red + warp * kG * (D + 2));
        __syncthreads();
        constexpr int kOutRow = kFinal ? D : D + 1;  // kFinal: O only
        const long long first = (((b + map.row_shift) * KV + kvh) * C + ch + map.slot_shift) * kG * kOutRow;
        for (int e = threadIdx.x; e < kG * kOutRow; e += kThreadsPerTask) {
          const int g = e / kOutRow, d = e % kOutRow;
          float mx = -INFINITY;
#pragma unroll
          for (int w = 0; w < warps; ++w) mx = fmaxf(mx, red[(w * kG + g) * (D + 2)]);
          float sum = 0.f, o = 0.f;
          if (mx != -INFINITY) {
#pragma unroll
            for (int w = 0; w < warps; ++w) {
              const float* s = red + (w * kG + g) * (D + 2);
              const float f = exp2f(s[0] - mx);
              sum += s[1] * f;
              if (d < D) o += s[2 + d] * f;
            }
          }
          if constexpr (kFinal) {
            static_cast<T*>(env.buffers[c.out_buffer])[first + e] = from_f<T>(sum > 0.f ? o / sum : 0.f);
          } else {
            static_cast<float*>(env.buffers[c.out_buffer])[first + e] =
                d < D ? (sum > 0.f ? o / sum : 0.f) : (sum > 0.f ? mx + log2f(sum) : -INFINITY);
          }
        }
        __syncthreads();
        phase.mark(3);
      }
    }
  }
}

// The task: the page-table reads of the tile's first sequence and chunk (AttnStart), then the
// gate, then attn_partial_impl — so the K/V copies go out as soon as the gate opens, two round
// trips earlier. Inlined into the dispatch, which is where the gate must be opened: with the
// gate inside attn_partial_impl, even first thing, the fused rope tests whose attention waits
// on a computed cos/sin table read that table stale
// (test_fused_rope_attention_matches_eager[1-128-0-True-True]), although the gates opened on
// all of the producer's arrivals and the SASS polled, invalidated L1 and passed the barrier
// before the loads; cause not found.
// kRagged: qo_indptr's order is checked (each warp, qo_ok) and the first row looked up before
// the gate too; a qo_indptr at fault leaves the task after its gate.
// The first row's lookups of a ragged tile (rows from r.lo[0], chunk ch of `splits`, segments
// ending at or before tile_end): what attn_partial_impl takes as `first`.
template <int kPer, typename T, typename I>
__device__ __forceinline__ RaggedStart ragged_start(const OpC& c, const TaskEnv& env, long long t, long long ch,
                                                    long long splits, long long tile_end, bool ok) {
  const ViewC &indptr = c.in[2], &indices = c.in[3], &last = c.in[4];
  const int page_size = static_cast<int>(c.iparam[1]);
  RaggedStart first;
  const RaggedRow row = ok ? ragged_row<I>(env, indptr, indices, last, c.in[5], t, page_size, c.out_buffer)
                           : RaggedRow{SeqSpan{0, 0}, -1, 0};
  first.span = row.span;
  ragged_extent(row, tile_end, first.m, first.lim);
  const ChunkSplit k = split_rows_chunk(first.m, first.lim, ch, splits, kAttnStep<kPer, T>);
  const long long at = k.base + (threadIdx.x & 31) % k.ku;  // this lane's position of the first step
  first.page = at < k.t1 ? page_of<I>(env, indices, first.span.first_page, at, log2_pow2(page_size)) : 0;
  first.new_page = 0;
  return first;
}

// Writes the empty state (O = 0, lse = −inf) of rows [t0, t1), kv heads [k0, k1), slot ch of
// states [S, KV, C, kG, D + 1]: a balanced tile's unused item (or rows past the last token).
template <int kPer, int kG>
__device__ __forceinline__ void empty_states(const OpC& c, const TaskEnv& env, long long t0, long long t1,
                                             long long k0, long long k1, long long ch) {
  constexpr int D = 32 * kPer;
  const long long KV = c.out_shape[1], C = c.out_shape[2], heads = k1 - k0;
  const long long n = max(0LL, t1 - t0) * heads * kG * (D + 1);
  float* out = static_cast<float*>(env.buffers[c.out_buffer]);
  for (long long e = threadIdx.x; e < n; e += kThreadsPerTask) {
    const int d = static_cast<int>(e % (D + 1));
    const long long g = e / (D + 1) % kG, kvh = k0 + e / (D + 1) / kG % heads, t = t0 + e / (D + 1) / kG / heads;
    out[(((t * KV + kvh) * C + ch) * kG + g) * (D + 1) + d] = d < D ? 0.f : -INFINITY;
  }
}

// The balanced split's items of a tile (attn_plan: the plan is c.in[plan_input], made in this
// launch, so read after the gate): storage row b of row block i = ⌊b / R⌋, slot ch, is item
// w = i·C + ch, which works for block item_block[w] (−1: none) as its chunk w − block_start
// of block_start[i+1] − block_start[i]. fn(rect, map) attends one item's rows [src rows of
// the tile's rows of block i, that chunk]; the rest get the empty state.
template <int kPer, int kG, typename Fn>
__device__ __forceinline__ void for_plan_items(const OpC& c, const Rect& r, const TaskEnv& env, int plan_input,
                                               long long R, Fn&& fn) {
  const long long T = c.in[0].shape[0], C = c.out_shape[2], NB = (T + R - 1) / R;
  const ViewC& pv = c.in[plan_input];
  const int* plan = static_cast<const int*>(env.buffers[pv.buffer]) + pv.offset;
  const int* start = plan + NB * C;
  for (long long i = r.lo[0] / R; i * R < r.hi[0]; ++i) {
    const long long b0 = max(r.lo[0], i * R), b1 = min(r.hi[0], i * R + R);
    for (long long ch = r.lo[2]; ch < r.hi[2]; ++ch) {
      const long long w = i * C + ch, src = plan[w];
      const long long t0 = src * R + (b0 - i * R), t1 = min(T, src * R + (b1 - i * R));
      if (src < 0 || t0 >= t1) {
        empty_states<kPer, kG>(c, env, b0, b1, r.lo[1], r.hi[1], ch);
        __syncthreads();
        continue;
      }
      if (t1 - t0 < b1 - b0) empty_states<kPer, kG>(c, env, b0 + (t1 - t0), b1, r.lo[1], r.hi[1], ch);
      const long long j = w - start[src];
      Rect rr = r;
      rr.lo[0] = t0;
      rr.hi[0] = t1;
      rr.lo[2] = j;
      rr.hi[2] = j + 1;
      fn(rr, TileMap{b0 - t0, ch - j, start[src + 1] - start[src], min(T, src * R + R)});
      __syncthreads();  // the next item reuses the scratch area
    }
  }
}

// kTableAfterGate: the graph rewrites the page table for its next iteration (the
// start-of-iteration task, iteration.cuh), so a task started before its event fired could read
// the previous iteration's: it reads the table only once the gate has opened.
template <int kPer, int kG, typename T, typename I, bool kRope, bool kFinal, bool kRagged = false, bool kPlan = false,
          bool kTableAfterGate = false>
__device__ __forceinline__ void attn_partial(const OpC& c, const Rect& r, const TaskEnv& gated) {
  if (kTableAfterGate && !acquire_inputs(gated)) return;
  const TaskEnv env{gated.buffers, kTableAfterGate ? nullptr : gated.gate};  // (an open gate: acquire returns at once)
  constexpr int kU = kAttnStep<kPer, T>;
  const ViewC &indptr = c.in[2], &indices = c.in[3], &last = c.in[4];
  const int C = kFinal ? 1 : static_cast<int>(c.out_shape[2]);
  const int page_size = static_cast<int>(c.iparam[1]), shift = log2_pow2(page_size);
  const long long ch0 = kFinal ? 0 : r.lo[2];
  if constexpr (kPlan) {  // the balanced split: the plan is made in this launch
    static_assert(kRagged && !kRope && !kFinal, "a plan splits the ragged form's chunks");
    const bool ok = qo_ok<I>(env, c.in[5], c.in[0].shape[0], c.out_buffer);
    if (!acquire_inputs(env) || !ok) return;
    for_plan_items<kPer, kG>(c, r, env, 6, c.iparam[2], [&](const Rect& rr, const TileMap& map) {
      const RaggedStart first = ragged_start<kPer, T, I>(c, env, rr.lo[0], rr.lo[2], map.splits, map.tile_end, true);
      attn_partial_impl<kPer, kG, T, I, false, false, true>(c, rr, env, first, map);
    });
    return;
  }
  AttnStartOf<kRagged> first;
  bool ok = true;
  if constexpr (kRagged) {
    ok = qo_ok<I>(env, c.in[5], c.out_shape[0], c.out_buffer);
    first = ragged_start<kPer, T, I>(c, env, r.lo[0], ch0, C, r.hi[0], ok);
  } else {
    first.span = seq_span<I>(env, indptr, indices, last, r.lo[0], page_size, c.out_buffer);
    const ChunkSplit k = split_chunk(first.span, ch0, C, kRope, kU);
    const long long at = k.base + (threadIdx.x & 31) % k.ku;  // this lane's position of the first step
    first.page = at < k.t1 ? page_of<I>(env, indices, first.span.first_page, at, shift) : 0;
  }
  // warps kG and kG + 1 append k and v in the sequence's last chunk, which may be a later chunk
  // of this tile than ch0 (the page does not depend on the chunk)
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const long long pos = kRope && warp >= kG && warp < kG + 2 ? rope_position(first.span, c.in[1], c.out_buffer, r.lo[0])
                                                              : -1;
  first.new_page = pos >= 0 ? page_of<I>(env, indices, first.span.first_page, pos, shift) : 0;
  if (!acquire_inputs(env) || !ok) return;
  const TileMap map{0, 0, C, r.hi[0]};
  attn_partial_impl<kPer, kG, T, I, kRope, kFinal, kRagged>(c, r, env, first, map);
#ifdef MPK_ATTN_WARM_RERUN
  // diagnostic (benchmarks/linear_phases.py --warm-rerun): the same work again, its code and
  // data now warm, timed in its own phase slot; idempotent (the same k/v appended, the same
  // output written)
  attn_partial_impl<kPer, kG, T, I, kRope, kFinal, kRagged, kAttnWarmSlot>(c, r, env, first, map);
#endif
}

// input states [B, KV, C, G, D+1]; output [B, H, D] of type T. One warp per (b, h); lane l
// holds dims l + 32·i. ⊕ over all C chunks at once: with M the largest lse and
// S = Σ_c 2^(lse_c − M), out = Σ_c 2^(lse_c − M) / S · O_c, which is what folding the states
// with ⊕ one by one computes (mpk.ops.paged.merge_states); no chunk (all lse = −inf) gives 0.
// The lse pass is lane-parallel; the weighted sum keeps 4 chunks' loads in flight.
template <int kPer, typename T>
__device__ __noinline__ void attn_merge_impl(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int D = 32 * kPer;
  const ViewC& st = c.in[0];
  const int C = static_cast<int>(st.shape[2]), G = static_cast<int>(st.shape[3]);
  const int H = static_cast<int>(c.out_shape[1]);
  const int heads = static_cast<int>(r.hi[1] - r.lo[1]);
  const int rows = static_cast<int>(r.hi[0] - r.lo[0]) * heads;
  const int lane = threadIdx.x & 31;
  const float* states = static_cast<const float*>(env.buffers[st.buffer]) + st.offset;
  const long long chunk_stride = static_cast<long long>(G) * (D + 1);
  for (int job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long b = r.lo[0] + job / heads, h = r.lo[1] + job % heads;
    const float* first = states + ((b * st.shape[1] + h / G) * C * G + h % G) * (D + 1);
    float mx = -INFINITY;
    for (int ch = lane; ch < C; ch += 32) mx = fmaxf(mx, first[ch * chunk_stride + D]);
    mx = warp_max(mx);
    float o[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.f;
    if (mx != -INFINITY) {
      float sum = 0.f;
#pragma unroll 4
      for (int ch = 0; ch < C; ++ch) {
        const float* s = first + ch * chunk_stride;
        const float w = exp2f(s[D] - mx);
        sum += w;
#pragma unroll
        for (int i = 0; i < kPer; ++i) o[i] += w * s[lane + 32 * i];
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) o[i] /= sum;
    }
    T* out = static_cast<T*>(env.buffers[c.out_buffer]) + (b * H + h) * D;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = from_f<T>(o[i]);
  }
}

// attn_merge of the balanced split — inputs states [S, KV, C, G, D+1] (a row's items spread
// over the slots as attn_plan placed them) and the plan; iparam[0]: rows R of a block. Row t's
// items are w ∈ [block_start[i], block_start[i+1]) of its block i = ⌊t / R⌋, item w's state at
// storage row ⌊w / C⌋·R + t mod R, slot w mod C; ⊕ over them as attn_merge_impl does over chunks.
template <int kPer, typename T>
__device__ __noinline__ void attn_merge_planned(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int D = 32 * kPer;
  const ViewC &st = c.in[0], &pv = c.in[1];
  const long long KV = st.shape[1], C = st.shape[2], G = st.shape[3], R = c.iparam[0];
  const long long Tn = c.out_shape[0], H = c.out_shape[1], NB = (Tn + R - 1) / R;
  const int* start = static_cast<const int*>(env.buffers[pv.buffer]) + pv.offset + NB * C;
  const int heads = static_cast<int>(r.hi[1] - r.lo[1]);
  const int rows = static_cast<int>(r.hi[0] - r.lo[0]) * heads;
  const int lane = threadIdx.x & 31;
  const float* states = static_cast<const float*>(env.buffers[st.buffer]) + st.offset;
  const auto state = [&](long long w, long long t, long long h) {
    return states + (((w / C * R + t % R) * KV + h / G) * C + w % C) * G * (D + 1) + (h % G) * (D + 1);
  };
  for (int job = threadIdx.x >> 5; job < rows; job += blockDim.x >> 5) {
    const long long t = r.lo[0] + job / heads, h = r.lo[1] + job % heads;
    const long long w0 = start[t / R], w1 = start[t / R + 1];
    float mx = -INFINITY;
    for (long long w = w0 + lane; w < w1; w += 32) mx = fmaxf(mx, state(w, t, h)[D]);
    mx = warp_max(mx);
    float o[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.f;
    if (mx != -INFINITY) {
      float sum = 0.f;
#pragma unroll 4
      for (long long w = w0; w < w1; ++w) {
        const float* s = state(w, t, h);
        const float f = exp2f(s[D] - mx);
        sum += f;
#pragma unroll
        for (int i = 0; i < kPer; ++i) o[i] += f * s[lane + 32 * i];
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) o[i] /= sum;
    }
    T* out = static_cast<T*>(env.buffers[c.out_buffer]) + (t * H + h) * D;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[lane + 32 * i] = from_f<T>(o[i]);
  }
}

}  // namespace mpk

// Task family: the ragged form's attention a block of rows at a time on the tensor cores
// (attn_prefill: ragged attn_partial tiles of several rows, 16-bit K/V of head dim 64 or 128,
// G ≤ 8; mpk.ops.paged documents the form, _prefill_block picks this task). FlashInfer's
// prefill form: a warp's MMA rows are query rows, ⌊8 / G⌋ token rows × their G heads, so that a
// K/V row staged in shared memory serves every head of every row of the block; the CTA's 8
// warps take blocks of one sequence's rows (a pass: up to 8 blocks) over CTA-wide K/V steps.
#pragma once
#include "paged_attention.cuh"

namespace mpk {

// Positions of one CTA-wide K/V step: K and V rows of 16 KiB each (kPrefillStageBytes in all;
// mpk.ops.paged.PREFILL_STAGE_BYTES), one step in the scratch area and the next in dynamic
// shared memory, so that a step's copies fly while the warps attend to the other.
constexpr int kPrefillStageBytes = 32768;
template <int kPer, typename T>
constexpr int kPrefillRows = kPrefillStageBytes / (2 * 32 * kPer * static_cast<int>(sizeof(T)));

// Row u's 16-byte piece p in a step's K or V rows (rows of D elements, pieces XOR-swizzled by
// row: piece p of row u sits at p ^ (u % 8), so ldmatrix's 8 rows of one piece hit distinct
// banks); rows from u0 + valid on read row u0 instead (finite data: their scores are masked
// and their weights 0, and 0 · finite = 0, where a stale row could hold anything).
template <int D, typename T>
__device__ __forceinline__ const T* step_piece(const T* rows, int u0, int i, int p, int valid) {
  const int u = u0 + (i < valid ? i : 0);
  return rows + u * D + ((p ^ (u & 7)) << 3);
}

// One warp's online-softmax states of a block of query rows on the tensor cores: query row g
// (< 8) is head g % G of the block's token row g / G (⌊8 / G⌋ rows: g < ⌊8 / G⌋·G; the rest
// unused). MmaHeadStates' form, with rows for heads: per 16 positions, S = Q·Kᵀ takes the query
// rows as the MMA's rows (8 of 16 used) and 8 positions as its columns; its accumulator,
// exponentiated and rounded to T, is already the B operand of Oᵀ += Vᵀ·Pᵀ (O transposed, so
// that the 16-row side holds dims): lane (g, t) holds row g's scores at positions 2t, 2t + 1
// of each 8, and Oᵀ at dims 16j + g (+ 8) of rows 2t, 2t + 1. (The form with the MMA's 16 rows
// all query rows holds 16 × D accumulators a warp: the kernel's registers, shared with the
// runtime around every task, do not take them.) Each row is masked to positions below its
// limit (its position + 1: causal; 0: no row). P is rounded to T before its product with V (as
// FlashAttention does); Σ P and O stay in fp32. LSE base 2, as everywhere in paged attention.
template <int kPer, int kG, typename T>
struct RowBlockStates {
  static constexpr int D = 32 * kPer, kRows = 8 / kG;
  static_assert(kG <= 8 && (D == 64 || D == 128) && sizeof(T) == 2, "RowBlockStates: G ≤ 8, D 64 or 128, 16-bit T");
  static constexpr int kSaved = 2 + D / 4;  // floats a lane saves for a merge: its row's m and Σ p, its Oᵀ
  uint32_t qa[D / 16][2];  // Q's A fragments per 16 dims: row g at dims 2t (+1) and 8 + 2t (+9); rows ≥ 8 are 0
  float o[D / 16][4];      // Oᵀ: (dim 16j + g, rows 2t, 2t + 1), (dim 16j + g + 8, rows 2t, 2t + 1)
  float m, l;              // row g's running max; this lane's share of its Σ p (all of it after finish)
  int lim;                 // row g: positions below this are attended

  // q0: head 0 of the block's first token row (row stride rs, head stride hs); rows: the
  // block's token rows (0: none); pos0: the first row's position
  __device__ __forceinline__ void start(const T* q0, long long rs, long long hs, int rows, int pos0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, r = g / kG;
    const bool ok = g < kRows * kG && r < rows;
    lim = ok ? pos0 + r + 1 : 0;
    const T* row = q0 + r * rs + (g % kG) * hs;
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) qa[j][h] = ok ? *reinterpret_cast<const uint32_t*>(row + 16 * j + 8 * h + 2 * t) : 0u;
    m = -INFINITY;
    l = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  }

  // Positions pos0 … pos0 + 15, rows u0 … u0 + 15 of a step's K and V (the first `valid` of
  // them loaded; u0 a multiple of 8, as the swizzle needs); scale: the softmax scale · log2(e).
  __device__ __forceinline__ void step(const T* k, const T* v, int u0, int valid, int pos0, float scale) {
    const int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, r8 = lane & 7;
    float s[2][4];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      s[b][0] = s[b][1] = s[b][2] = s[b][3] = 0.f;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // two 16-dim k steps per ldmatrix: pieces 4j + mi
        uint32_t kb[4];
        ldmatrix_x4<false>(kb, step_piece<D>(k, u0, 8 * b + r8, 4 * j + mi, valid));
        mma16816<T>(s[b], qa[2 * j][0], 0u, qa[2 * j][1], 0u, kb[0], kb[1]);
        mma16816<T>(s[b], qa[2 * j + 1][0], 0u, qa[2 * j + 1][1], 0u, kb[2], kb[3]);
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int u = 8 * b + 2 * t + e;
        s[b][e] = u < valid && pos0 + u < lim ? s[b][e] * scale : -INFINITY;
        mx = fmaxf(mx, s[b][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing attended yet: p = 0, not NaN
    const float corr = exp2f(m - base);
    float psum = 0.f;
    uint32_t pb[2];  // Pᵀ's B fragment: positions 2t (+1), then 8 + 2t (+1)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float p0 = exp2f(s[b][0] - base), p1 = exp2f(s[b][1] - base);
      psum += p0 + p1;
      pb[b] = pack2<T>(p0, p1);
    }
    l = l * corr + psum;
    m = m_new;
    // Oᵀ's columns are rows 2t and 2t + 1, whose factors lanes 8t and 8t + 4 hold
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t), c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      o[j][0] *= c0;
      o[j][1] *= c1;
      o[j][2] *= c0;
      o[j][3] *= c1;
      uint32_t va[4];  // Vᵀ's A fragment: matrices (positions 0–7 | 8–15) × (dims 16j | 16j + 8)
      ldmatrix_x4<true>(va, step_piece<D>(v, u0, 8 * (mi >> 1) + r8, 2 * j + (mi & 1), valid));
      mma16816<T>(o[j], va[0], va[1], va[2], va[3], pb[0], pb[1]);
    }
  }

  // Row g's Σ p over the quad: every lane of the quad then holds its row's whole (m, Σ p).
  __device__ __forceinline__ void finish() {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
  }

  // This lane's finished state into w ([kSaved][32] floats, lane-contiguous), and ⊕ of such a
  // saved state (another warp's over the same rows) into this finished one.
  __device__ __forceinline__ void save(float* w) const {
    const int lane = threadIdx.x & 31;
    w[lane] = m;
    w[32 + lane] = l;
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) w[(2 + 4 * j + e) * 32 + lane] = o[j][e];
  }
  __device__ __forceinline__ void merge(const float* w) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    float fa[2], fb[2];  // the factors of rows 2t and 2t + 1 (this lane's Oᵀ columns)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float ma = __shfl_sync(0xffffffffu, m, 8 * t + 4 * h), mb = w[8 * t + 4 * h];
      const float mx = fmaxf(ma, mb), base = mx == -INFINITY ? 0.f : mx;
      fa[h] = exp2f(ma - base);
      fb[h] = exp2f(mb - base);
    }
    const float mb = w[lane], m_new = fmaxf(m, mb), base = m_new == -INFINITY ? 0.f : m_new;
    l = l * exp2f(m - base) + w[32 + lane] * exp2f(mb - base);
    m = m_new;
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[j][e] = o[j][e] * fa[e & 1] + w[(2 + 4 * j + e) * 32 + lane] * fb[e & 1];
  }

  // The block's rows' finished states (kFinal: O in T) of kv head kvh, chunk ch; row0: its
  // first token row. Every lane takes part (the shuffles).
  template <bool kFinal>
  __device__ __forceinline__ void write(void* out, int row0, int kvh, int ch, int KV, int C) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qr = 2 * t + h;  // the query row of this lane's Oᵀ column h
      const float sum = __shfl_sync(0xffffffffu, l, 4 * qr), mx = __shfl_sync(0xffffffffu, m, 4 * qr);
      const int row_lim = __shfl_sync(0xffffffffu, lim, 4 * qr);
      if (row_lim == 0) continue;  // no row (lim 0 also for query rows past ⌊8 / G⌋·G)
      const long long row = row0 + qr / kG, head = qr % kG;  // (64-bit: the output's offsets)
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      if constexpr (kFinal) {
        T* dst = static_cast<T*>(out) + ((row * KV + kvh) * kG + head) * D;
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          dst[16 * j + g] = from_f<T>(o[j][h] * inv);
          dst[16 * j + g + 8] = from_f<T>(o[j][2 + h] * inv);
        }
      } else {
        float* dst = static_cast<float*>(out) + (((row * KV + kvh) * C + ch) * kG + head) * (D + 1);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          dst[16 * j + g] = o[j][h] * inv;
          dst[16 * j + g + 8] = o[j][2 + h] * inv;
        }
        if (g == 0) dst[D] = sum > 0.f ? mx + log2f(sum) : -INFINITY;
      }
    }
  }
};

// The K and V rows of positions at … at + count − 1 of a sequence (its pages; rows: its kv
// head's rows in the layer's cache, V rows v_stride further) into a step buffer (K rows, then V
// rows kPrefillRows further; swizzled as step_piece reads them), one cp.async group of the
// whole CTA: each thread looks up the pages of its rows first (the loads in flight together),
// then copies. A page outside the cache is read as page 0 (nothing out of bounds); the result
// says whether this thread met one. Out of line: its addressing would otherwise hold registers
// across attn_prefill_impl's loops, which the kernel's own state shares around every task.
template <int kPer, typename T, typename I>
__device__ __noinline__ bool issue_kv_step(SeqPages<I> pages, const T* rows, long long v_stride, long long page_stride,
                                           long long row_stride, long long num_pages, int page_size, int at, int count,
                                           T* buf) {
  constexpr int D = 32 * kPer, kP = kPrefillRows<kPer, T>, kPieces = D * static_cast<int>(sizeof(T)) / 16;
  constexpr int kRowsPerRound = kThreadsPerTask / kPieces, kRounds = kP / kRowsPerRound;
  static_assert(kP % kRowsPerRound == 0, "a step's rows: whole copy rounds");
  long long src[kRounds];
  bool bad = false;
#pragma unroll
  for (int k = 0; k < kRounds; ++k) {
    const int u = static_cast<int>(threadIdx.x) / kPieces + k * kRowsPerRound;
    const int x = at + min(u, count - 1);
    const long long pg = pages(x);
    const bool ok = page_ok(pg, num_pages);
    bad |= !ok && u < count;
    src[k] = (ok ? pg : 0) * page_stride + (x & (page_size - 1)) * row_stride;
  }
  const int p = static_cast<int>(threadIdx.x) % kPieces;
#pragma unroll
  for (int k = 0; k < kRounds; ++k) {
    const int u = static_cast<int>(threadIdx.x) / kPieces + k * kRowsPerRound;
    if (u < count) {
      T* dst = buf + u * D + ((p ^ (u & 7)) << 3);
      const T* from = rows + src[k] + p * (16 / sizeof(T));
      cp_async16(dst, from);
      cp_async16(dst + kP * D, from + v_stride);
    }
  }
  cp_async_commit();
  return bad;
}

// attn_prefill — attn_partial's ragged inputs (q [T, H, D], kv_cache, kv_indptr, kv_indices,
// kv_last_page_len, qo_indptr), iparam (layer, page_size), fparam[0] scale and output (states
// [T, KV, C, G, D+1] fp32; kFinal: O [T, KV, G, D] of T). The tile's rows fall into segments,
// one sequence's rows each; chunk c of a segment covers chunk c of its positions up to its last
// row's in the tile (split_rows_chunk's chunks). A segment's rows go in passes of up to 8 blocks
// of ⌊8 / G⌋ rows; a pass of nb blocks gives each S = 8 / nb (rounded to a power of two) warps,
// which split each K/V step's positions and merge their states afterwards (through the scratch
// area, in halving rounds: a fixed order), so that a pass of few rows (a decode's, or the end of
// a prompt) still keeps the warps busy. Per (pass, kv head, chunk) the CTA copies K/V steps of
// kPrefillRows positions up to the pass's last row's position (causal: nothing later is read),
// two in flight; a warp skips the steps past its block's last row. Padding rows get the empty
// state (O = 0, lse = −inf).
template <int kPer, int kG, typename T, typename I, bool kFinal>
__device__ __noinline__ void attn_prefill_impl(const OpC& c, const Rect& r, const TaskEnv& env, const TileMap& map) {
  constexpr int D = 32 * kPer, kP = kPrefillRows<kPer, T>;
  using St = RowBlockStates<kPer, kG, T>;
  constexpr int kRows = St::kRows, kSlotFloats = 32 * St::kSaved;
  static_assert(kP % 64 == 0, "a step's rows: whole shares of 8 warps, each whole 8-row swizzle blocks");
  static_assert(4 * kSlotFloats <= kScratchFloats, "the merge's saved states (4 at most per round) fit the scratch area");
  static_assert(kP * D * sizeof(T) * 2 <= kScratchFloats * sizeof(float), "a K/V step fits the scratch area");
  const ViewC &q = c.in[0], &cache = c.in[1], &indptr = c.in[2], &indices = c.in[3], &last = c.in[4], &qo = c.in[5];
  const int KV = static_cast<int>(c.out_shape[1]), C = kFinal ? 1 : static_cast<int>(c.out_shape[2]);
  const int page_size = static_cast<int>(c.iparam[1]), shift = log2_pow2(page_size);
  const float scale = c.fparam[0] * kLog2e;
  const int warp = threadIdx.x >> 5;
  T* const stage0 = reinterpret_cast<T*>(scratch());
  T* const stage1 = reinterpret_cast<T*>(norm_tile());
  void* const out = env.buffers[c.out_buffer];
  const I* qp = static_cast<const I*>(env.buffers[qo.buffer]) + qo.offset;
  const long long B = qo.shape[0] - 1, qs = qo.stride[0], used = qp[B * qs];
  const long long ch0 = kFinal ? 0 : r.lo[2], ch1 = kFinal ? 1 : r.hi[2];
  {  // padding rows: the empty state
    const long long p0 = max(r.lo[0], used), heads = r.hi[1] - r.lo[1], chunks = ch1 - ch0;
    const int width = kFinal ? D : D + 1;
    const long long n = max(0LL, r.hi[0] - p0) * heads * chunks * kG * width;
    for (long long e = threadIdx.x; e < n; e += kThreadsPerTask) {
      const int d = static_cast<int>(e % width), h = static_cast<int>(e / width % kG);
      const long long rest = e / width / kG, ch = ch0 + rest % chunks, kvh = r.lo[1] + rest / chunks % heads;
      const long long row = p0 + rest / chunks / heads + map.row_shift;
      if constexpr (kFinal) {
        static_cast<T*>(out)[((row * KV + kvh) * kG + h) * D + d] = from_f<T>(0.f);
      } else {
        static_cast<float*>(out)[(((row * KV + kvh) * C + ch + map.slot_shift) * kG + h) * (D + 1) + d] =
            d < D ? 0.f : -INFINITY;
      }
    }
  }
  const long long num_pages = cache.shape[2], page_stride = cache.stride[2], row_stride = cache.stride[4];
  const T* qbase = static_cast<const T*>(env.buffers[q.buffer]) + q.offset;
  // rows and positions in 32 bits (a task's registers are few: the O accumulators take 64)
  const int rows_end = static_cast<int>(min(r.hi[0], used)), tile_end = static_cast<int>(map.tile_end);
  for (int t = static_cast<int>(r.lo[0]); t < rows_end;) {  // the tile's segments: rows [t, seg_end) of sequence b
    const long long b = qo_sequence(qp, qs, B, t);
    const int r0 = static_cast<int>(qp[b * qs]), r1 = static_cast<int>(qp[(b + 1) * qs]);
    const int seg_end = min(tile_end, r1);
    const SeqSpan span = seq_span<I>(env, indptr, indices, last, b, page_size, c.out_buffer);
    if (r1 - r0 > span.len) {  // more new rows than the sequence's length: not followed
      if (threadIdx.x == 0) report_bad_input(kBadQoLen, c.out_buffer, b, r1 - r0, span.len);
      t = seg_end;
      continue;
    }
    const int pos_t = static_cast<int>(span.len - r1 + t);     // row t's position
    const int m = static_cast<int>(span.len - (r1 - seg_end));  // the segment's last row's position + 1
    const SeqPages<I> pages(env, indices, span.first_page, shift);
    for (int p0 = t; p0 < seg_end; p0 += 8 * kRows) {  // passes of up to 8 blocks
      const int p1 = min(seg_end, p0 + 8 * kRows);
      const int nb = (p1 - p0 + kRows - 1) / kRows;
      const int S = nb <= 1 ? 8 : nb <= 2 ? 4 : nb <= 4 ? 2 : 1;  // warps per block
      const int qb = warp / S, j = warp % S;
      const int row0 = p0 + qb * kRows;  // the warp's block's first row
      const int rows = qb < nb ? min(kRows, p1 - row0) : 0;
      const int pos0 = pos_t + (row0 - t), blk_lim = rows ? pos0 + rows : 0;
      const int pass_lim = pos_t + (p1 - t);  // the pass's last row's position + 1
      for (int kvh = static_cast<int>(r.lo[1]); kvh < r.hi[1]; ++kvh) {
        const T* kbase = static_cast<const T*>(env.buffers[cache.buffer]) + cache.offset + c.iparam[0] * cache.stride[0] +
                         kvh * cache.stride[3];
        for (int ch = static_cast<int>(ch0); ch < ch1; ++ch) {
          const long long used_chunks = min(map.splits, max(1LL, static_cast<long long>(m) / kMinChunk));
          const int c0 = static_cast<int>(ch < used_chunks ? ch * static_cast<long long>(m) / used_chunks : m);
          const int hi = min(pass_lim, static_cast<int>(ch < used_chunks ? (ch + 1) * static_cast<long long>(m) / used_chunks
                                                                          : m));
          const int steps = hi > c0 ? (hi - c0 + kP - 1) / kP : 0;
          St st;
          st.start(qbase + row0 * q.stride[0] + kvh * kG * q.stride[1], q.stride[0], q.stride[1], rows, pos0);
          bool bad_page = false;
          const auto issue = [&](int at, T* buf) {
            bad_page |= issue_kv_step<kPer, T>(pages, kbase, cache.stride[1], page_stride, row_stride, num_pages,
                                              page_size, at, min(kP, hi - at), buf);
          };
          if (steps > 0) issue(c0, stage0);
          if (steps > 1) issue(c0 + kP, stage1);
#pragma unroll 1
          for (int s = 0; s < steps; ++s) {
            T* const buf = s & 1 ? stage1 : stage0;
            if (s + 1 < steps)
              cp_async_wait_pending<1>();  // this step's group, not the next one's
            else
              cp_async_wait_pending<0>();
            __syncthreads();
            const int at = c0 + s * kP, count = min(kP, hi - at);
            const int share = kP / S, a1 = min(count, (j + 1) * share);
#pragma unroll 1
            for (int u = j * share; u < a1 && at + u < blk_lim; u += 16)
              st.step(buf, buf + kP * D, u, min(16, a1 - u), at + u, scale);
            __syncthreads();  // the buffer is refilled
            if (s + 2 < steps) issue(at + 2 * kP, buf);
          }
          if (bad_page) report_bad_page(pages, span.first_page, span.len, num_pages, c.out_buffer);
          // the S warps of a block merge their states in halving rounds (warp j takes j + half's)
          st.finish();
          for (int half = S / 2; half >= 1; half >>= 1) {
            __syncthreads();  // the step buffers, or the last round's saved states, are free
            if (rows && j >= half && j < 2 * half) st.save(scratch() + (qb * half + j - half) * kSlotFloats);
            __syncthreads();
            if (rows && j < half) st.merge(scratch() + (qb * half + j) * kSlotFloats);
          }
          if (rows && j == 0)
            st.template write<kFinal>(out, row0 + static_cast<int>(map.row_shift), kvh,
                                      ch + static_cast<int>(map.slot_shift), KV, C);
          __syncthreads();  // the next steps' copies overwrite the scratch area
        }
      }
    }
    t = seg_end;
  }
}

// The task: qo_indptr's order checked (each warp; a graph input, before the gate), then the
// gate, then the tile; a qo_indptr at fault leaves the task after its gate.
// kPlan: the balanced split's items (for_plan_items in paged_attention.cuh), each a block's rows
// over one chunk of its items.
template <int kPer, int kG, typename T, typename I, bool kFinal, bool kPlan = false>
__device__ __forceinline__ void attn_prefill(const OpC& c, const Rect& r, const TaskEnv& env) {
  const bool ok = qo_ok<I>(env, c.in[5], c.in[0].shape[0], c.out_buffer);
  if (!acquire_inputs(env) || !ok) return;
  if constexpr (kPlan) {
    static_assert(!kFinal, "a plan splits chunks");
    for_plan_items<kPer, kG>(c, r, env, 6, c.iparam[2], [&](const Rect& rr, const TileMap& map) {
      attn_prefill_impl<kPer, kG, T, I, false>(c, rr, env, map);
    });
  } else {
    attn_prefill_impl<kPer, kG, T, I, kFinal>(c, r, env, TileMap{0, 0, kFinal ? 1 : c.out_shape[2], r.hi[0]});
  }
}

}  // namespace mpk

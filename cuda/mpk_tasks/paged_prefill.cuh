// Task family: the ragged form's attention a block of rows at a time on the tensor cores
// (attn_prefill: ragged attn_partial tiles of several rows, 16-bit K/V of head dim 64 or 128,
// G ≤ 8; mpk.ops.paged documents the form, _prefill_block picks this task). FlashInfer's
// prefill form: a warp's 16 MMA rows are query rows, ⌊16 / G⌋ token rows × their G heads, so
// that a K/V row staged in shared memory serves every head of every row of the block; the CTA's
// 8 warps take blocks of one sequence's rows (a pass: up to 8 blocks) over CTA-wide K/V steps.
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

// One warp's online-softmax states of a block of query rows on the tensor cores, FlashAttention-2's
// form: the MMA's 16 rows are query rows, row g (< 16) head g % G of the block's token row g / G
// (⌊16 / G⌋ rows: g < ⌊16 / G⌋·G; the rest unused). Per 16 positions, S = Q·Kᵀ takes 8 positions
// as the MMA's columns; its accumulators, exponentiated and rounded to T, are already P's A
// fragment for O += P·V. Lane (g, t) holds rows g and g + 8: their scores at positions 2t, 2t + 1
// of each 8, and O at dims 8n + 2t, 8n + 2t + 1. Each row is masked to positions below its
// limit (its position + 1: causal; 0: no row). P is rounded to T before its product with V (as
// FlashAttention does); Σ P and O stay in fp32. LSE base 2, as everywhere in paged attention.
template <int kPer, int kG, typename T>
struct RowBlockStates {
  static constexpr int D = 32 * kPer, kRows = 16 / kG;
  static_assert(kG <= 16 && (D == 64 || D == 128) && sizeof(T) == 2, "RowBlockStates: G ≤ 16, D 64 or 128, 16-bit T");
  static constexpr int kSaved = 4 + D / 2;  // floats a lane saves for a merge: m and Σ p of its two rows, its O
  uint32_t qa[D / 16][4];  // Q's A fragments per 16 dims: rows g, g + 8 at dims 2t (+1), then 8 + 2t (+9)
  float o[D / 8][4];       // O: (row g, dims 8n + 2t, +1), (row g + 8, the same dims)
  float m[2], l[2];        // rows g, g + 8: running max; this lane's share of Σ p (all of it after finish)
  int lim[2];              // rows g, g + 8: positions below this are attended

  // q0: head 0 of the block's first token row (row stride rs, head stride hs); rows: the
  // block's token rows (0: none); pos0: the first row's position
  __device__ __forceinline__ void start(const T* q0, long long rs, long long hs, int rows, int pos0) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const T* row[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qr = g + 8 * h, r = qr / kG;
      const bool ok = qr < kRows * kG && r < rows;
      lim[h] = ok ? pos0 + r + 1 : 0;
      row[h] = ok ? q0 + r * rs + (qr % kG) * hs : nullptr;
      m[h] = -INFINITY;
      l[h] = 0.f;
    }
    const auto at = [&](int h, int d) { return row[h] ? *reinterpret_cast<const uint32_t*>(row[h] + d) : 0u; };
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      qa[j][0] = at(0, 16 * j + 2 * t);
      qa[j][1] = at(1, 16 * j + 2 * t);
      qa[j][2] = at(0, 16 * j + 8 + 2 * t);
      qa[j][3] = at(1, 16 * j + 8 + 2 * t);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  }

  // Positions pos0 … pos0 + 15, rows u0 … u0 + 15 of a step's K and V (the first `valid` of
  // them loaded; u0 a multiple of 8, as the swizzle needs); scale: the softmax scale · log2(e).
  __device__ __forceinline__ void step(const T* k, const T* v, int u0, int valid, int pos0, float scale) {
    const int lane = threadIdx.x & 31, t = lane & 3, mi = lane >> 3, r8 = lane & 7;
    float s[2][4];  // S over positions 8b + 2t (+1): [b][0..1] row g, [b][2..3] row g + 8
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      s[b][0] = s[b][1] = s[b][2] = s[b][3] = 0.f;
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // two 16-dim k steps per ldmatrix: pieces 4j + mi
        uint32_t kb[4];
        ldmatrix_x4<false>(kb, step_piece<D>(k, u0, 8 * b + r8, 4 * j + mi, valid));
        mma16816<T>(s[b], qa[2 * j][0], qa[2 * j][1], qa[2 * j][2], qa[2 * j][3], kb[0], kb[1]);
        mma16816<T>(s[b], qa[2 * j + 1][0], qa[2 * j + 1][1], qa[2 * j + 1][2], qa[2 * j + 1][3], kb[2], kb[3]);
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int u = 8 * b + 2 * t + (e & 1), h = e >> 1;
        s[b][e] = u < valid && pos0 + u < lim[h] ? s[b][e] * scale : -INFINITY;
        mx[h] = fmaxf(mx[h], s[b][e]);
      }
    float base[2], corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m[h], mx[h]);
      base[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing attended yet: p = 0, not NaN
      corr[h] = exp2f(m[h] - base[h]);
      m[h] = m_new;
    }
    float p[2][4], psum[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[b][e] = exp2f(s[b][e] - base[e >> 1]);
        psum[e >> 1] += p[b][e];
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * corr[h] + psum[h];
    // P's A fragment (16 rows × 16 positions): rows g, g + 8 at positions 2t (+1), then 8 + 2t (+9)
    const uint32_t pa0 = pack2<T>(p[0][0], p[0][1]), pa1 = pack2<T>(p[0][2], p[0][3]);
    const uint32_t pa2 = pack2<T>(p[1][0], p[1][1]), pa3 = pack2<T>(p[1][2], p[1][3]);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
#pragma unroll
      for (int n = 2 * j; n < 2 * j + 2; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
      uint32_t vb[4];  // V's B fragments: matrices (positions 0–7 | 8–15) × (dims 16j | 16j + 8)
      ldmatrix_x4<true>(vb, step_piece<D>(v, u0, 8 * (mi & 1) + r8, 2 * j + (mi >> 1), valid));
      mma16816<T>(o[2 * j], pa0, pa1, pa2, pa3, vb[0], vb[1]);
      mma16816<T>(o[2 * j + 1], pa0, pa1, pa2, pa3, vb[2], vb[3]);
    }
  }

  // Each row's Σ p over the quad: every lane of the quad then holds its rows' whole (m, Σ p).
  __device__ __forceinline__ void finish() {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
  }

  // This lane's finished state into w ([kSaved][32] floats, lane-contiguous), and ⊕ of such a
  // saved state (another warp's over the same rows) into this finished one.
  __device__ __forceinline__ void save(float* w) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      w[h * 32 + lane] = m[h];
      w[(2 + h) * 32 + lane] = l[h];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) w[(4 + 4 * n + e) * 32 + lane] = o[n][e];
  }
  __device__ __forceinline__ void merge(const float* w) {
    const int lane = threadIdx.x & 31;
    float fa[2], fb[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mb = w[h * 32 + lane], mx = fmaxf(m[h], mb), base = mx == -INFINITY ? 0.f : mx;
      fa[h] = exp2f(m[h] - base);
      fb[h] = exp2f(mb - base);
      l[h] = l[h] * fa[h] + w[(2 + h) * 32 + lane] * fb[h];
      m[h] = mx;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] = o[n][e] * fa[e >> 1] + w[(4 + 4 * n + e) * 32 + lane] * fb[e >> 1];
  }

  // The block's rows' finished states (kFinal: O in T) of kv head kvh, chunk ch; row0: its
  // first token row.
  template <bool kFinal>
  __device__ __forceinline__ void write(void* out, int row0, int kvh, int ch, int KV, int C) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (lim[h] == 0) continue;  // no row (lim 0 also for query rows past ⌊16 / G⌋·G)
      const int qr = g + 8 * h;
      const long long row = row0 + qr / kG, head = qr % kG;  // (64-bit: the output's offsets)
      const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
      if constexpr (kFinal) {
        T* dst = static_cast<T*>(out) + ((row * KV + kvh) * kG + head) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      } else {
        float* dst = static_cast<float*>(out) + (((row * KV + kvh) * C + ch) * kG + head) * (D + 1);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          dst[8 * n + 2 * t] = o[n][2 * h] * inv;
          dst[8 * n + 2 * t + 1] = o[n][2 * h + 1] * inv;
        }
        if (t == 0) dst[D] = l[h] > 0.f ? m[h] + log2f(l[h]) : -INFINITY;
      }
    }
  }
};

// The pages of a CTA-wide K/V step's rows, thread by thread: a thread copies rows
// threadIdx.x / kPieces + k·kRowsPerRound (k < kRounds) of the step, 16-byte piece
// threadIdx.x % kPieces of each. Looked up a step ahead of their copies (kv_step_pages), so that
// the page table's latency hides behind a step of MMAs instead of stalling every thread.
template <int kPer, typename T, typename I>
struct KvStepPages {
  static constexpr int D = 32 * kPer, kP = kPrefillRows<kPer, T>, kPieces = D * static_cast<int>(sizeof(T)) / 16;
  static constexpr int kRowsPerRound = kThreadsPerTask / kPieces, kRounds = kP / kRowsPerRound;
  static_assert(kP % kRowsPerRound == 0, "a step's rows: whole copy rounds");
  I page[kRounds];
};

// The pages of positions at … at + count − 1 (count ≥ 1): the loads are issued, their values
// wanted only by issue_kv_step.
template <int kPer, typename T, typename I>
__device__ __forceinline__ KvStepPages<kPer, T, I> kv_step_pages(SeqPages<I> pages, int at, int count) {
  using P = KvStepPages<kPer, T, I>;
  P out;
#pragma unroll
  for (int k = 0; k < P::kRounds; ++k)
    out.page[k] = pages(at + min(static_cast<int>(threadIdx.x) / P::kPieces + k * P::kRowsPerRound, count - 1));
  return out;
}

// The K and V rows of positions at … at + count − 1 of a sequence (their pages looked up by
// kv_step_pages; rows: its kv head's rows in the layer's cache, V rows v_stride further) into
// a step buffer (K rows, then V rows kPrefillRows further; swizzled as step_piece reads them),
// one cp.async group of the whole CTA. A page outside the cache is read as page 0 (nothing out
// of bounds); the result says whether this thread met one. Out of line: its addressing would
// otherwise hold registers across attn_prefill_impl's loops, which the kernel's own state shares
// around every task.
template <int kPer, typename T, typename I>
__device__ __noinline__ bool issue_kv_step(KvStepPages<kPer, T, I> pg, const T* rows, long long v_stride,
                                           long long page_stride, long long row_stride, long long num_pages,
                                           int page_size, int at, int count, T* buf) {
  using P = KvStepPages<kPer, T, I>;
  constexpr int D = P::D, kP = P::kP;
  bool bad = false;
  const int p = static_cast<int>(threadIdx.x) % P::kPieces;
#pragma unroll
  for (int k = 0; k < P::kRounds; ++k) {
    const int u = static_cast<int>(threadIdx.x) / P::kPieces + k * P::kRowsPerRound;
    const bool ok = page_ok(pg.page[k], num_pages);
    bad |= !ok && u < count;
    if (u < count) {
      const long long src = (ok ? static_cast<long long>(pg.page[k]) : 0) * page_stride +
                            ((at + u) & (page_size - 1)) * row_stride;
      T* dst = buf + u * D + ((p ^ (u & 7)) << 3);
      const T* from = rows + src + p * (16 / sizeof(T));
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
// of ⌊16 / G⌋ rows; a pass of nb blocks gives each S = 8 / nb (rounded to a power of two) warps,
// which split each K/V step's positions and merge their states afterwards (through the scratch
// area, in halving rounds: a fixed order), so that a pass of few rows (a decode's, or the end of
// a prompt) still keeps the warps busy. Per (pass, kv head, chunk) the CTA copies K/V steps of
// kPrefillRows positions up to the pass's last row's position (causal: nothing later is read),
// two in flight (their pages looked up a step before their copies); a warp skips the steps past its block's last row. Padding rows get the empty
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
          const auto lookup = [&](int at) { return kv_step_pages<kPer, T>(pages, at, min(kP, hi - at)); };
          const auto issue = [&](int at, const KvStepPages<kPer, T, I>& pg, T* buf) {
            bad_page |= issue_kv_step<kPer, T>(pg, kbase, cache.stride[1], page_stride, row_stride, num_pages,
                                              page_size, at, min(kP, hi - at), buf);
          };
          if (steps > 0) issue(c0, lookup(c0), stage0);
          if (steps > 1) issue(c0 + kP, lookup(c0 + kP), stage1);
#pragma unroll 1
          for (int s = 0; s < steps; ++s) {
            T* const buf = s & 1 ? stage1 : stage0;
            const int at = c0 + s * kP, count = min(kP, hi - at);
            KvStepPages<kPer, T, I> next;  // step s + 2's pages, in flight during this step's MMAs
            if (s + 2 < steps) next = lookup(at + 2 * kP);
            if (s + 1 < steps)
              cp_async_wait_pending<1>();  // this step's group, not the next one's
            else
              cp_async_wait_pending<0>();
            __syncthreads();
            const int share = kP / S, a1 = min(count, (j + 1) * share);
#pragma unroll 1
            for (int u = j * share; u < a1 && at + u < blk_lim; u += 16)
              st.step(buf, buf + kP * D, u, min(16, a1 - u), at + u, scale);
            __syncthreads();  // the buffer is refilled
            if (s + 2 < steps) issue(at + 2 * kP, next, buf);
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

// Task family: linear algebra. ``matmul`` (a [..., M, K] @ b [..., K, N] (+ bias), batch dims
// broadcast, with the fused prologues and epilogues its attrs name) in two paths — the
// bandwidth-grade decode linear (tensor cores, weights streamed with 16-byte loads), picked by
// codegen when the views allow it, and the general one, one thread per output element — and
// ``embedding``.
#pragma once
#include "pointwise.cuh"  // silu_times: the SiLU·mul epilogue
#include "rows.cuh"       // rms_scale8, warp_rstd: the RMSNorm prologue, as rms_norm normalises

namespace mpk {

constexpr int kLinRows = 16;     // rows (batch) a variant-1 tile may hold: the MMA's M
constexpr int kLinBlocks = 8;    // 8-column weight blocks per pass, at most: 64 columns
// kLinInFlight (common.cuh, beside the gate_share that holds warp 0's share of them): 16-byte
// weight loads each lane keeps in flight, about: a pass of kBlocks blocks goes
// kLinUnroll(kBlocks) 32-wide K steps deep, the nearest whole number (15 for 3 and 18 for 6
// blocks, 16 for 2, 4 and 8)
__host__ __device__ constexpr int lin_unroll(int blocks) { return (kLinInFlight + blocks / 2) / blocks; }

// A 16-byte load that bypasses L1: weights are read exactly once. (An L2 evict-first hint on
// these loads made decode steps no faster.)
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// A bf16 value as float, from its bits.
__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }

// Where warp w's partial sum of (row, col) sits in shared memory: [warp][16 rows][64 columns],
// the column pair (2u, 2u + 1) of a row r at pair u ^ 4(r & 3). Both accesses then hit 32
// distinct banks: the MMA fragments' float2 stores (a half-warp's lanes (g, t) store pair
// 4j + t of rows g that differ mod 4) and the epilogue's reads (consecutive columns of a
// row). Stored [warp][column][row], the epilogue's reads would be 16-way bank conflicts.
__host__ __device__ __forceinline__ int red_index(int warp, int row, int col) {
  return (warp * kLinRows + row) * 64 + (((col >> 1) ^ ((row & 3) << 2)) << 1 | (col & 1));
}

// The fast path: out [M, N] = alpha·x [M, K]·W [N, K]ᵀ (+ beta·bias), x and W bf16 with unit stride
// along K, 16-byte aligned rows, K % 32 == 0, at most 16 rows per tile (codegen checks all of
// it). One m16n8k16 MMA takes the tile's rows (zero-padded to 16) against 8 weight rows. A
// lane loads 8 consecutive k of one weight row in one 16-byte load; the dot product does not
// care about the order of k, so the A fragment is loaded with the same k permutation and no
// shuffle is needed. The 8 warps split K (every 8th 32-wide step), each with
// kLinInFlight loads in flight (kBlocks blocks × kLinInFlight / kBlocks k steps: a tile of few
// columns goes deeper along K); their partial sums meet in shared memory and are added in warp
// order (deterministic), then the epilogue scales, adds the bias (the residual of a decoder
// layer) and stores.
// The fused forms (flags, combinable; the matmul op's prologue / epilogue attrs):
// kNormPrologue: prologue "rms_norm" — input 2 is an RMSNorm weight g over K (fparam[2] is eps).
//   After its gate the task copies its rows of x into shared memory (norm_tile; one round
//   trip, as the plain form's first activation loads), and normalises them there with
//   rms_norm's sums and roundings (bf16(bf16(x·rstd)·g), the thread ↔ element map of the
//   rms_norm task, so the result equals the unfused pair's); the K loop then reads its
//   activations from the tile. g's words are copied into shared memory (red, free until the
//   first partials) before the gate. (Applying x·g and rstd inside the K loop is slower:
//   the loop's pace is set by the path from its loads to its MMAs.) The tile holds row r's
//   16-byte word j at j ^ 4(r & 1): the rows g and g + 1 a quarter warp reads then fall in
//   different banks.
// kSiluEpilogue: epilogue "silu_mul" (with or without a prologue) — W has 2N rows, gate then
//   up; a pass takes 4 blocks of gate rows and the 4 matching blocks of up rows and stores
//   silu(gate)·up, each factor rounded to bf16 first, as the unfused projection and silu_mul
//   would.
// kStatsEpilogue: epilogue "norm_stats" — the residual projection before an RMSNorm of weight
//   g (input 3) also stores h·g and each group's Σh² (groups of 16 or 8 columns, the output's
//   last dim: a butterfly over as many lanes' h², in the epilogue), packed as mpk/ops/linalg.py
//   lays out; r is 2-d here.
// kStatsPrologue: prologue "norm_stats" — the projection after that norm reads h·g as a plain
//   matmul reads x; the sums (input 2) go to shared memory by cp.async after the gate, are
//   added up after the first K loop into each row's rstd, and the epilogue scales by it.
enum LinearForm : int { kPlain = 0, kNormPrologue = 1, kSiluEpilogue = 2, kStatsEpilogue = 4, kStatsPrologue = 8 };
constexpr int kMaxStatsGroup = 16;  // columns per sum of squares: 16 or 8 (mpk.ops.linalg.STATS_GROUPS)

// The phase timer's slot of a form: its index in the forms instantiated (benchmarks/
// linear_phases.py: FORMS, same order) · kLinBlockCounts + the index of kBlocks among 2, 3, 4, 6, 8.
__host__ __device__ constexpr int linear_phase_slot(int form, int blocks) {
  constexpr int kForms[] = {kPlain, kNormPrologue, kSiluEpilogue, kNormPrologue | kSiluEpilogue, kStatsEpilogue,
                            kStatsPrologue, kStatsPrologue | kSiluEpilogue};
  int i = 0;
  while (kForms[i] != form) ++i;
  return i * kLinBlockCounts + (blocks == 2 ? 0 : blocks == 3 ? 1 : blocks == 4 ? 2 : blocks == 6 ? 3 : 4);
}

template <int kBlocks, int kForm>
__device__ __noinline__ void linear_bf16(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr bool kNorm = kForm & kNormPrologue, kGlu = kForm & kSiluEpilogue;
  constexpr bool kStatsOut = kForm & kStatsEpilogue, kStatsIn = kForm & kStatsPrologue;
  constexpr int kLinUnroll = lin_unroll(kBlocks), kWarps = kThreadsPerTask / 32;
  constexpr int kWarp0Words = 32 * kLinUnroll * kBlocks;  // warp 0's first loads, through gate_share
  static_assert(kWarp0Words <= kGateShareWords, "gate_share too small for this block count");
  static_assert(!(kForm & kSiluEpilogue) || kBlocks == kLinBlocks, "SiLU·mul passes are 4 gate + 4 up blocks");
  // The next pass's first weights go out at the end of a pass (see below), except in the SiLU·mul
  // forms without the norm prologue, where issuing them early made the gate·up tasks slower
  // rather than faster.
  constexpr bool kPassPrefetch = !kGlu || kNorm;
  // phases (MPK_PHASES): 5 the loads before the gate, 0 the gate and the prologue; per pass 1 K
  // loop, 2 partials to shared memory, 3 epilogue, 4 closing barrier
  constexpr int kPhaseSlot = linear_phase_slot(kForm, kBlocks);
  PhaseTimer phase(kPhaseSlot);
  constexpr int kOut = kGlu ? 4 * kBlocks : 8 * kBlocks;  // output columns per pass
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  // kStatsOut: the output is [3, M, N/G, G] (h, h·g, sums), r the rows × columns rect
  // kStatsOut / kStatsIn: columns per sum of squares (the output's last dim, or iparam[1])
  const int group = kStatsOut ? static_cast<int>(c.out_shape[3]) : kStatsIn ? c.iparam[1] : kMaxStatsGroup;
  const long long K = a.shape[1], N = kStatsOut ? c.out_shape[2] * group : c.out_shape[1];
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(env.buffers[a.buffer]) + a.offset;
  const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(env.buffers[b.buffer]) + b.offset;
  const long long lda = a.stride[0], ldw = b.stride[1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long m0 = r.lo[0];
  const int rows = static_cast<int>(r.hi[0] - m0), ksteps = static_cast<int>(K / 32);
  const bool has_lo = g < rows, has_hi = g + 8 < rows;
  const __nv_bfloat16* x_lo = x + (m0 + g) * lda + 8 * t;
  const __nv_bfloat16* x_hi = x + (m0 + g + 8) * lda + 8 * t;
  float* red = scratch();  // the warps' partial sums: [warp][16 rows][64 columns] (red_index)
  float* red_ss = red + 8 * 64 * kLinRows;  // kNorm: [warp][16 rows], each warp's sums of x²
  const int words = static_cast<int>(K / 8);  // kNorm: 16-byte words of a row of x
  const auto swz = [](int row, int j) { return j ^ ((row & 1) << 2); };
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // A pass's weight rows: 8·kBlocks rows of W (kGlu: 4·kBlocks gate rows, then the matching up
  // rows N further), lane (g, t) reading row g of each 8-row block at k offset 8t.
  const __nv_bfloat16* wrow[kBlocks];
  bool valid[kBlocks];
  int cols = 0;
  const auto start_pass = [&](long long n0) {
    cols = static_cast<int>(min(static_cast<long long>(kOut), r.hi[1] - n0));
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) {
      const int col = 8 * (kGlu ? j % (kBlocks / 2) : j) + g;  // the output column it feeds
      valid[j] = col < cols;
      wrow[j] = w + (n0 + col + (kGlu && j >= kBlocks / 2 ? N : 0)) * ldw + 8 * t;
    }
  };
  uint4 wv[kLinUnroll][kBlocks];
  const auto load_weights = [&](int ks, bool on = true) {  // !on: zeros, nothing loaded
#pragma unroll
    for (int u = 0; u < kLinUnroll; ++u) {
      const int k = ks + u * kWarps;
#pragma unroll
      for (int j = 0; j < kBlocks; ++j) wv[u][j] = on && k < ksteps && valid[j] ? ld_stream(wrow[j] + 32LL * k) : zero;
    }
  };
  // Weights first: they depend on nothing the graph computes (codegen picks this variant only
  // for weights that are graph inputs, and the only input a task writes is a paged KV cache,
  // in place), so the first step's loads go out before the task's event has fired
  // (acquire_inputs) and before the bias and the activations, whose latencies then hide
  // under theirs. Warp 0 polls the gate, so warps 1–7 copy its first weights into shared
  // memory (gate_share: its poll would wait behind its own loads) and it takes them from there
  // before the K loop.
  start_pass(r.lo[1]);
  GateShare& share = gate_share();
  unsigned long long share_token = 0;  // warp 0's lane 0: the phase of share.bar it waits for
  if (warp != 0) {
    // warp 0's loads: word e is its lane e % 32's block (e / 32) % kBlocks of step u = e / (32·kBlocks)
    for (int e = threadIdx.x - 32; e < kWarp0Words; e += kThreadsPerTask - 32) {
      const int u = e / (32 * kBlocks), j = (e / 32) % kBlocks, gl = (e % 32) >> 2, tl = e & 3;
      const int col = 8 * (kGlu ? j % (kBlocks / 2) : j) + gl;
      const int k = u * kWarps;
      const bool ok = col < cols && k < ksteps;
      const __nv_bfloat16* src = w + (r.lo[1] + col + (kGlu && j >= kBlocks / 2 ? N : 0)) * ldw + 8 * tl + 32LL * k;
      cp_async16_or_zero(share.words + e, ok ? src : w, ok);
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(gate_share_bar()) : "memory");
  }
  // (a predicate rather than a branch around warp 0's loads: ptxas spilled the branch form)
  load_weights(warp, warp != 0);
  if (warp == 0 && lane == 0)
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(share_token) : "r"(gate_share_bar()) : "memory");
  // kNorm: warps 1–7 copy the norm weight (a graph input too) into red, free until the first
  // pass's partials: its 16-byte word j at gsm[j] (in registers it took 16 of the K loop's)
  const uint4* gsm = reinterpret_cast<const uint4*>(red);
  if (kNorm && warp != 0) {
    const ViewC& nw = c.in[2];
    const auto* g16 = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(env.buffers[nw.buffer]) + nw.offset);
#pragma unroll 1
    for (int j = threadIdx.x - 32; j < words; j += kThreadsPerTask - 32) cp_async16(red + 4 * j, g16 + j);
  }
  phase.mark(5);
  if (!acquire_inputs(env)) {
    cp_async_wait_all();  // nothing lands in shared memory after the task left
    return;
  }
  // kStatsIn: half warp `srow` copies row srow's sums into red (free until the first pass's
  // partials), lane l taking groups l, l + 16, … (the order mpk.ops.linalg.stats_rstd adds them)
  const int group_shift = __ffs(group) - 1;  // a power of two: no 64-bit division
  const int groups = static_cast<int>(K >> group_shift), srow = threadIdx.x >> 4, slane = threadIdx.x & 15;
  if constexpr (kStatsIn) {
    const ViewC& sv = c.in[2];
    const __nv_bfloat16* st = static_cast<const __nv_bfloat16*>(env.buffers[sv.buffer]) + sv.offset + (m0 + srow) * sv.stride[0];
    if (srow < rows)
      for (int q = slane; q < groups; q += 16) cp_async4(red + srow * groups + q, st + (q << group_shift));
  }
  uint4* tile = nullptr;  // kNorm: the rows of x, normalised
  if constexpr (kNorm) {
    tile = norm_tile();
    for (int e = threadIdx.x; e < rows * words; e += blockDim.x) {
      const int row = e / words, j = e % words;
      cp_async16(tile + row * words + swz(row, j), x + (m0 + row) * lda + 8 * j);
    }
    cp_async_wait_all();
    __syncthreads();
    // rms_norm's sums and roundings: thread t adds the squares of words t, t + 256, … in order
    // (warp_sum_squares, rows.cuh); loops, not unrolled: the prologue's code is fetched by
    // every task, so short code matters more than loop overhead
#pragma unroll 1
    for (int row = 0; row < rows; ++row) {
      float ss = 0.f;
#pragma unroll 1
      for (int j = threadIdx.x; j < words; j += kThreadsPerTask) ss += sum_squares8(tile[row * words + swz(row, j)]);
      ss = warp_sum(ss);
      if (lane == 0) red_ss[warp * kLinRows + row] = ss;
    }
    __syncthreads();
#pragma unroll 1
    for (int row = 0; row < rows; ++row) {
      const float rstd = warp_rstd(red_ss + row, kLinRows, static_cast<int>(K), c.fparam[2]);
#pragma unroll 1
      for (int j = threadIdx.x; j < words; j += kThreadsPerTask) {
        uint4& word = tile[row * words + swz(row, j)];
        word = rms_scale8(word, gsm[j], rstd);
      }
    }
    __syncthreads();
  }
  // the bias (a decoder layer's residual): bf16, broadcast by zero strides (codegen checks)
  const __nv_bfloat16* bias = nullptr;
  long long bs0 = 0, bs1 = 0;
  if ((kForm == kPlain || kForm == kStatsEpilogue) && c.num_inputs > 2) {
    const ViewC& v = c.in[2];
    bias = static_cast<const __nv_bfloat16*>(env.buffers[v.buffer]) + v.offset;
    if (v.ndim >= 1) bs1 = v.shape[v.ndim - 1] == 1 ? 0 : v.stride[v.ndim - 1];
    if (v.ndim == 2) bs0 = v.shape[0] == 1 ? 0 : v.stride[0];
  }
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(env.buffers[c.out_buffer]);
  const long long part = kStatsOut ? c.out_shape[1] * N : 0;  // kStatsOut: elements of one of the 3 parts
  constexpr int kPerThread = (kLinRows * kOut + kThreadsPerTask - 1) / kThreadsPerTask;  // epilogue outputs per thread
  if (warp == 0) {  // its first weights, copied by warps 1–7
    // abandoned only when the launch was stopped: the task then runs on to its end (every warp
    // reaches its barriers) and the worker leaves without its arrival
    if (lane == 0) (void)mbarrier_wait(gate_share_bar(), share_token);
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kLinUnroll; ++u)
#pragma unroll
      for (int j = 0; j < kBlocks; ++j) wv[u][j] = share.words[(u * kBlocks + j) * 32 + lane];
  }
  phase.mark(0);
  for (long long n0 = r.lo[1]; n0 < r.hi[1]; n0 += kOut) {
    if (!kPassPrefetch && n0 != r.lo[1]) start_pass(n0);
    const int pass_cols = cols;  // start_pass of the next pass moves `cols` on
    // The pass's bias values and (kStatsOut) the norm weight at each output's column, loaded
    // now so that they arrive while the weights stream: as bf16 bits, converted in the epilogue,
    // and loaded by every thread (a thread without that output reads x instead) — a load inside
    // a conditional, converted there, makes the warp wait for it at the branch's end, before its
    // first activation loads.
    unsigned short bv[kPerThread], gv[kStatsOut ? kPerThread : 1];
    const ViewC& gview = c.in[kStatsOut ? 3 : 0];  // kStatsOut: the next norm's weight, one per column
    const __nv_bfloat16* gnorm = static_cast<const __nv_bfloat16*>(env.buffers[gview.buffer]) + gview.offset;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreadsPerTask;
      const bool live = e < rows * pass_cols;
      const __nv_bfloat16* bp = bias && live ? bias + (m0 + e / pass_cols) * bs0 + (n0 + e % pass_cols) * bs1 : x;
      bv[j] = __ldcg(reinterpret_cast<const unsigned short*>(bp));
      if constexpr (kStatsOut) gv[j] = __ldcg(reinterpret_cast<const unsigned short*>(live ? gnorm + (n0 + e % pass_cols) * gview.stride[0] : x));
    }
    float acc[kBlocks][4];
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int ks = warp; ks < ksteps; ks += kWarps * kLinUnroll) {
      if (ks != warp || (!kPassPrefetch && n0 != r.lo[1])) load_weights(ks);  // else loaded ahead
      uint4 lo[kLinUnroll], hi[kLinUnroll];
#pragma unroll
      for (int u = 0; u < kLinUnroll; ++u) {
        const int k = ks + u * kWarps;
        const bool ok = k < ksteps;
        if constexpr (kNorm) {  // word 4k + t of rows g and g + 8 (same parity: same swizzle)
          lo[u] = ok && has_lo ? tile[g * words + swz(g, 4 * k + t)] : zero;
          hi[u] = ok && has_hi ? tile[(g + 8) * words + swz(g, 4 * k + t)] : zero;
        } else {  // activations are written inside the kernel: coherent (L2) loads, not the read-only path
          lo[u] = ok && has_lo ? __ldcg(reinterpret_cast<const uint4*>(x_lo + 32LL * k)) : zero;
          hi[u] = ok && has_hi ? __ldcg(reinterpret_cast<const uint4*>(x_hi + 32LL * k)) : zero;
        }
      }
#pragma unroll
      for (int u = 0; u < kLinUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
          mma16816<__nv_bfloat16>(acc[j], lo[u].x, hi[u].x, lo[u].y, hi[u].y, wv[u][j].x, wv[u][j].y);
          mma16816<__nv_bfloat16>(acc[j], lo[u].z, hi[u].z, lo[u].w, hi[u].w, wv[u][j].z, wv[u][j].w);
        }
      }
    }
    // The next pass's first weights go out now, under this pass's reduction and epilogue:
    // a wide tile (an LM head's ~1000 columns: 16 passes) would otherwise drain the SM's
    // loads at every pass boundary.
    if (kPassPrefetch && n0 + kOut < r.hi[1]) {
      start_pass(n0 + kOut);
      load_weights(warp);
    }
    phase.mark(1);
    if constexpr (kStatsIn) {
      if (n0 == r.lo[1]) {  // each row's rstd, kept in red_ss for the later passes
        cp_async_wait_all();
        float ss = 0.f;
        if (srow < rows)
          for (int q = slane; q < groups; q += 16) ss += red[srow * groups + q];
#pragma unroll
        for (int o = 8; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (slane == 0 && srow < rows) red_ss[srow] = rsqrtf(ss / static_cast<float>(K) + c.fparam[2]);
        __syncthreads();  // all sums read: red takes the partials now
      }
    }
    // accumulator fragment: rows g and g + 8, columns 2t and 2t + 1 of each 8-column block
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) {
      *reinterpret_cast<float2*>(red + red_index(warp, g, 8 * j + 2 * t)) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(red + red_index(warp, g + 8, 8 * j + 2 * t)) = make_float2(acc[j][2], acc[j][3]);
    }
    __syncthreads();
    phase.mark(2);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreadsPerTask;
      // kStatsOut: `group` consecutive lanes hold one row's aligned group of columns (tiles and
      // passes are whole groups), and all 32 lanes take part in its shuffles
      const bool live = e < rows * pass_cols;
      if (!kStatsOut && !live) break;
      const int row = live ? e / pass_cols : 0, col = live ? e % pass_cols : 0;
      float s = 0.f, up = 0.f;
      for (int v = 0; v < kWarps; ++v) {
        s += red[red_index(v, row, col)];
        if constexpr (kGlu) up += red[red_index(v, row, 32 + col)];
      }
      const float scale = kStatsIn ? red_ss[row] : c.fparam[0];  // rstd, or alpha
      if constexpr (kStatsOut) {
        const float h = round_to(kBF16, s * scale + c.fparam[1] * (bias ? bf16_bits_to_float(bv[j]) : 0.f));
        float sq = live ? h * h : 0.f;
#pragma unroll
        for (int o = kMaxStatsGroup / 2; o; o >>= 1)  // unrolled: constant shuffle offsets
          if (o < group) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        if (live) {
          const long long at = (m0 + row) * N + n0 + col;
          const unsigned bits = __float_as_uint(sq), k = col & (group - 1);
          out[at] = __float2bfloat16(h);
          out[part + at] = __float2bfloat16(h * bf16_bits_to_float(gv[j]));
          out[2 * part + at] = __ushort_as_bfloat16(static_cast<unsigned short>(k == 0 ? bits & 0xffffu : k == 1 ? bits >> 16 : 0u));
        }
        continue;
      }
      if constexpr (kGlu) {
        s = silu_times(round_to(kBF16, s * scale), round_to(kBF16, up * scale), kBF16);
      } else {
        s = s * scale + c.fparam[1] * (bias ? bf16_bits_to_float(bv[j]) : 0.f);
      }
      out[(m0 + row) * N + n0 + col] = __float2bfloat16(s);
    }
    phase.mark(3);
    __syncthreads();
    phase.mark(4);
  }
}

// The block count (columns per pass) by the tile's width: a tile of one pass takes the fewest
// blocks that cover it, so that no lane's share of the loads in flight goes to columns past
// the tile (a 48-column tile in 8 blocks kept 12 of 16 loads per lane in flight, 24 columns in
// 4 blocks 12 too); narrow tiles go deeper along K. (SiLU·mul always takes 8: one
// instantiation, 4 gate and 4 up blocks.)
template <int kForm>
__device__ __forceinline__ void linear_variant1(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long cols = r.hi[1] - r.lo[1];
  if constexpr ((kForm & kSiluEpilogue) != 0) {
    linear_bf16<kLinBlocks, kForm>(c, r, env);
  } else if (cols <= 16) {
    linear_bf16<2, kForm>(c, r, env);
  } else if (cols <= 24) {
    linear_bf16<3, kForm>(c, r, env);
  } else if (cols <= 32) {
    linear_bf16<4, kForm>(c, r, env);
  } else if (cols <= 48) {
    linear_bf16<6, kForm>(c, r, env);
  } else {
    linear_bf16<kLinBlocks, kForm>(c, r, env);
  }
}

// The general (variant-0) projection's dot products for output (row, col): Σ_k act(k, x[row, k])·b[k, col]
// and, with glu, the same against b[k, col + N] (the up half); act maps an activation as the op's
// prologue does (identity, or the RMSNorm's scaling with its roundings).
template <class Act>
__device__ __forceinline__ float2 gate_up_dots(const ViewC& a, const ViewC& b, const TaskEnv& env, long long row,
                                               long long col, long long N, bool glu, Act act) {
  const long long K = a.shape[1];
  float gate = 0.f, up = 0.f;
  for (long long k = 0; k < K; ++k) {
    const long long ia[2] = {row, k}, ig[2] = {k, col}, iu[2] = {k, col + N};
    const float v = act(k, load_f(env.buffers[a.buffer], a.dtype, view_index(a, ia, 2)));
    gate += v * load_f(env.buffers[b.buffer], b.dtype, view_index(b, ig, 2));
    if (glu) up += v * load_f(env.buffers[b.buffer], b.dtype, view_index(b, iu, 2));
  }
  return make_float2(gate, up);
}

// rsqrt(mean + eps) of row `row` from part 2 of a norm-stats epilogue's output of `group`-column
// groups viewed [M, K], in the variant-1 task's order (lane l adds groups l, l + 16, …, then the
// half warp's butterfly). Out of line: inlined into the dispatch, its loops over a run-time group
// pushed the persistent kernel past 255 registers (ptxas spilled), though the general task that
// calls it never runs in a decode step.
__device__ __noinline__ float stats_rstd(const ViewC& sv, const void* base, long long row, long long K, int group, float eps) {
  const auto* words = static_cast<const unsigned short*>(base) + sv.offset + row * sv.stride[0];
  const int shift = __ffs(group) - 1;  // group is a power of two
  float lane[16];
  for (int l = 0; l < 16; ++l) {
    lane[l] = 0.f;
    for (long long q = l; q < K >> shift; q += 16) {
      const long long at = (q << shift) * sv.stride[1];
      lane[l] += __uint_as_float(words[at] | static_cast<unsigned>(words[at + sv.stride[1]]) << 16);
    }
  }
  for (int o = 8; o; o >>= 1)
    for (int l = 0; l < o; ++l) lane[l] += lane[l + o];
  return rsqrtf(lane[0] / static_cast<float>(K) + eps);
}

// The plain projection's general form: out = alpha·a @ b (+ beta·bias), batch dims broadcast;
// fparam[0] alpha, fparam[1] beta; optional input 2 is the bias (broadcast to the output).
__device__ __forceinline__ void linear_general_plain(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const long long kdim = a.shape[a.ndim - 1];
  const long long n = rect_numel(r, c.ndim);
  const void* pa = env.buffers[a.buffer];
  const void* pb = env.buffers[b.buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims], ia[kMaxDims], ib[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    for (int d = 0; d < c.ndim; ++d) ia[d] = ib[d] = idx[d];
    float acc = 0.f;
    for (long long k = 0; k < kdim; ++k) {
      ia[c.ndim - 1] = k;
      ib[c.ndim - 2] = k;
      acc += load_f(pa, a.dtype, view_index(a, ia, c.ndim)) * load_f(pb, b.dtype, view_index(b, ib, c.ndim));
    }
    acc *= c.fparam[0];
    if (c.num_inputs > 2) {
      const ViewC& bias = c.in[2];
      acc += c.fparam[1] * load_f(env.buffers[bias.buffer], bias.dtype, view_index(bias, idx, c.ndim));
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, c.ndim), acc);
  }
}

// The norm-stats epilogue's general form over rc (rows × columns): out [3, M, N/G, G] = h =
// alpha·a @ b + beta·r, h·g, and each G-column group's Σh² as fp32 bits in the group's first two
// elements of part 2 (the rest 0; mpk/ops/linalg.py defines it; G = 16 or 8). Inputs a [M, K],
// b [K, N], r [M, N], g [N]; bf16 storage. A thread per (row, group).
__device__ __forceinline__ void linear_general_stats_out(const OpC& c, const Rect& rc, const TaskEnv& env) {
  const int group = static_cast<int>(c.out_shape[3]);
  const ViewC &a = c.in[0], &b = c.in[1], &res = c.in[2], &g = c.in[3];
  const long long K = a.shape[1], M = c.out_shape[1], N = c.out_shape[2] * group;
  const long long groups = (rc.hi[1] - rc.lo[1]) / group, n = (rc.hi[0] - rc.lo[0]) * groups;
  void* out = env.buffers[c.out_buffer];
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    const long long row = rc.lo[0] + e / groups, col0 = rc.lo[1] + e % groups * group;
    float sq[kMaxStatsGroup];
    for (int j = 0; j < group; ++j) {
      const long long col = col0 + j, ir[2] = {row, col}, ig[1] = {col};
      float acc = 0.f;
      for (long long k = 0; k < K; ++k) {
        const long long ia[2] = {row, k}, ib[2] = {k, col};
        acc += load_f(env.buffers[a.buffer], a.dtype, view_index(a, ia, 2)) * load_f(env.buffers[b.buffer], b.dtype, view_index(b, ib, 2));
      }
      const float h = round_to(c.out_dtype, acc * c.fparam[0] + c.fparam[1] * load_f(env.buffers[res.buffer], res.dtype, view_index(res, ir, 2)));
      store_f(out, c.out_dtype, row * N + col, h);
      store_f(out, c.out_dtype, (M + row) * N + col, h * load_f(env.buffers[g.buffer], g.dtype, view_index(g, ig, 1)));
      sq[j] = h * h;
    }
#pragma unroll
    for (int o = kMaxStatsGroup / 2; o; o >>= 1)  // the lanes' butterfly, as lane 0 adds (unrolled:
      if (o < group)                                // sq stays in registers)
#pragma unroll
        for (int j = 0; j < o; ++j) sq[j] += sq[j + o];
    const unsigned bits = __float_as_uint(sq[0]);
    auto* words = static_cast<unsigned short*>(out) + (2 * M + row) * N + col0;
    for (int j = 0; j < group; ++j) words[j] = static_cast<unsigned short>(j == 0 ? bits & 0xffffu : j == 1 ? bits >> 16 : 0u);
  }
}

// The general form of a 2-d projection with a prologue and / or the SiLU·mul epilogue, each
// output element alone: x [M, K], b [K, N] (kSiluEpilogue: [K, 2N], out = silu(h[:, :N])·h[:, N:],
// each factor rounded to the output dtype first).
// kNormPrologue: input 2 the RMSNorm weight w [K], iparam[1] the norm dtype, fparam[2] eps; out =
//   rms_norm(x, w) @ b with rms_norm's roundings.
// kStatsPrologue: x is h·g of a norm-stats epilogue's output, input 2 its sums [M, K] (groups of
//   iparam[1] columns), fparam[2] eps; out = rstd · (x @ b).
// Otherwise (SiLU·mul alone): fparam[0] alpha.
template <int kForm>
__device__ __forceinline__ void linear_general_2d(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr bool kNorm = kForm & kNormPrologue, kGlu = kForm & kSiluEpilogue, kStatsIn = kForm & kStatsPrologue;
  const ViewC &a = c.in[0], &b = c.in[1], &third = c.in[2];
  const long long K = a.shape[1], N = c.out_shape[1], n = rect_numel(r, 2);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, 2, e, idx);
    float out;
    if constexpr (kNorm) {
      float ss = 0.f;
      for (long long k = 0; k < K; ++k) {
        const long long ia[2] = {idx[0], k};
        const float v = load_f(env.buffers[a.buffer], a.dtype, view_index(a, ia, 2));
        ss += v * v;
      }
      const float rstd = rsqrtf(ss / K + c.fparam[2]);
      const float2 d = gate_up_dots(a, b, env, idx[0], idx[1], N, kGlu, [&](long long k, float x) {
        const long long iw[1] = {k};
        const float v = round_to(static_cast<int>(c.iparam[1]), x * rstd);
        return round_to(c.out_dtype, v * load_f(env.buffers[third.buffer], third.dtype, view_index(third, iw, 1)));
      });
      out = kGlu ? silu_times(round_to(c.out_dtype, d.x), round_to(c.out_dtype, d.y), c.out_dtype) : d.x;
    } else if constexpr (kStatsIn) {
      const float rstd = stats_rstd(third, env.buffers[third.buffer], idx[0], K, c.iparam[1], c.fparam[2]);
      const float2 d = gate_up_dots(a, b, env, idx[0], idx[1], N, kGlu, [](long long, float x) { return x; });
      out = kGlu ? silu_times(round_to(c.out_dtype, d.x * rstd), round_to(c.out_dtype, d.y * rstd), c.out_dtype)
                 : d.x * rstd;
    } else {
      const float2 d = gate_up_dots(a, b, env, idx[0], idx[1], N, true, [](long long, float x) { return x; });
      const float gate = round_to(c.out_dtype, d.x * c.fparam[0]), up = round_to(c.out_dtype, d.y * c.fparam[0]);
      out = silu_times(gate, up, c.out_dtype);
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, 2), out);
  }
}

// The matmul op's task, one instantiation per form (kForm: its LinearForm flags, from the op's
// prologue / epilogue attrs) and path, named by codegen per op so that a graph compiles only
// the forms it uses. kFast: the bandwidth-grade linear (linear_variant1: linear_bf16), which
// opens the gate itself after its first weight loads; else the general form (any dtypes and
// strides, one thread per output element or group), after the gate.
template <int kForm, bool kFast>
__device__ void linear_task(const OpC& c, const Rect& r, const TaskEnv& env) {
  if constexpr ((kForm & kStatsEpilogue) != 0) {
    const int group = static_cast<int>(c.out_shape[3]);
    Rect rc;  // rows × columns of the [3, M, N/G, G] tile
    rc.lo[0] = r.lo[1];
    rc.hi[0] = r.hi[1];
    rc.lo[1] = r.lo[2] * group;
    rc.hi[1] = r.hi[2] * group;
    if constexpr (kFast) {
      linear_variant1<kForm>(c, rc, env);
    } else {
      if (!acquire_inputs(env)) return;
      linear_general_stats_out(c, rc, env);
    }
  } else if constexpr (kFast) {
    linear_variant1<kForm>(c, r, env);
  } else {
    if (!acquire_inputs(env)) return;
    if constexpr (kForm == kPlain) {
      linear_general_plain(c, r, env);
    } else {
      linear_general_2d<kForm>(c, r, env);
    }
  }
}

// The table row of token id tok (of output row `row`), or -1: an id outside the vocabulary is
// reported, one another rank's shard holds (iparam[0] the shard's first row, iparam[1] the whole
// vocabulary, 0: the table's rows) is not; either row is written as zeros.
__device__ __forceinline__ long long table_row(const OpC& c, long long tok, long long row) {
  const long long rows = c.in[0].shape[0], vocab = c.iparam[1] ? c.iparam[1] : rows;
  if (tok < 0 || tok >= vocab) {
    report_bad_input(kBadTokenId, c.out_buffer, row, tok, vocab);
    return -1;
  }
  const long long local = tok - c.iparam[0];
  return local >= 0 && local < rows ? local : -1;
}

// out[..., d] = weight[ids[...] - iparam[0], d]; inputs weight [V, D], ids. Rows of a 2-byte table that
// copy as 16-byte words (the decode step's embedding) take the fast path: a thread per word of
// the tile, every row at once — the token ids in one round trip, then all the words (a loop
// over rows would cost a round trip pair per row); the general loop looks the id up per element.
__device__ void task_embedding(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& w = c.in[0];
  const ViewC& ids = c.in[1];
  const bool words = c.ndim == 2 && ids.ndim == 1 && w.dtype == c.out_dtype && (w.dtype == kBF16 || w.dtype == kF16) &&
                     w.stride[1] == 1 && w.offset % 8 == 0 && w.stride[0] % 8 == 0 && c.out_shape[1] % 8 == 0 &&
                     r.lo[1] % 8 == 0 && r.hi[1] % 8 == 0 &&
                     (reinterpret_cast<uintptr_t>(env.buffers[w.buffer]) | reinterpret_cast<uintptr_t>(env.buffers[c.out_buffer])) % 16 == 0;
  if (words) {
    const long long n = (r.hi[1] - r.lo[1]) / 8, words = (r.hi[0] - r.lo[0]) * n;
    const auto* table = static_cast<const uint4*>(env.buffers[w.buffer]);
    auto* out = static_cast<uint4*>(env.buffers[c.out_buffer]);
    for (long long e = threadIdx.x; e < words; e += blockDim.x) {
      const long long row = r.lo[0] + e / n, j = e % n;
      const long long tok = load_i(env.buffers[ids.buffer], ids.dtype, ids.offset + row * ids.stride[0]);
      uint4 v = make_uint4(0, 0, 0, 0);
      const long long t = table_row(c, tok, row);
      if (t >= 0) v = table[(w.offset + t * w.stride[0] + r.lo[1]) / 8 + j];
      out[(row * c.out_shape[1] + r.lo[1]) / 8 + j] = v;
    }
    return;
  }
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long tok = load_i(env.buffers[ids.buffer], ids.dtype, view_index(ids, idx, c.ndim - 1));
    const long long t = table_row(c, tok, ravel(idx, c.out_shape, c.ndim - 1));
    long long widx[2] = {t, idx[c.ndim - 1]};
    const long long o = ravel(idx, c.out_shape, c.ndim);
    if (t >= 0)
      move_elem(env.buffers[w.buffer], w.dtype, view_index(w, widx, 2), env.buffers[c.out_buffer], c.out_dtype, o);
    else
      store_i(env.buffers[c.out_buffer], c.out_dtype, o, 0);
  }
}

}  // namespace mpk

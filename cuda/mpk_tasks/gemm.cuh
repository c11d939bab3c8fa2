// Task family: the tensor-core GEMM — the ``matmul`` op's path for many rows (prefill):
// out [M, N] = alpha·x [M, K]·W [N, K]ᵀ (+ beta·bias), or with the SiLU·mul epilogue
// silu(x·Wgateᵀ)·(x·Wupᵀ), on Hopper's warpgroup MMA (wgmma). Codegen picks it from the op's
// row count (mpk/ops/linalg.py: GEMM_MIN_ROWS, gemm_blockers); the decode forms stay in linalg.cuh.
// A GEMM of too few sub-tiles to fill the workers is split over K (mpk/compiler/splitk.py): this
// task then writes each K slice's fp32 product (matmul_partial), and matmul_finish adds them.
//
// A task computes its tile of the output in sub-tiles of 128 rows × 128 MMA columns (128 output
// columns, or 64 with SiLU·mul: 64 gate and the matching 64 up rows of W). Warpgroup g (warps
// 4g … 4g + 3) owns rows 64g … 64g + 63 of a sub-tile: one m64n128k16 wgmma per 16 k, its 64
// fp32 accumulators a thread in registers. Operands come from shared memory, staged by every
// thread with cp.async in kGemmStages stages of 64 k (a 128-byte row of each operand row),
// stored in the 128-byte swizzle the wgmma descriptors name (16-byte chunk c of row r at
// chunk c ^ (r % 8), each stage's tiles 1024-byte aligned). Two stages' copies are in flight
// while the tensor cores work on a third and finish a fourth: a stage is refilled two k steps
// after the MMAs that read it were issued, and each warpgroup keeps one MMA batch in flight
// (wgmma.wait_group 1), so the stage a batch reads is free once the next step's barrier passed.
// Rows and columns outside the tile, and k past K (or the slice), are zero-filled (nothing
// outside the tile's declared input regions is read: another task may still be writing it); K
// must be a multiple of 8 (whole 16-byte chunks). The epilogue stores from the accumulators: alpha·acc +
// beta·bias (bias of type T, at most 2-d, broadcast by zero strides), or silu(gate)·up with each
// factor rounded to the output type first, as the unfused projection and silu_mul would.
#pragma once
#include "pointwise.cuh"  // silu_times: the SiLU·mul epilogue
#include "splitk.cuh"     // slice_bound: a partial product's K range

namespace mpk {

constexpr int kGemmRows = 128;  // output rows of a sub-tile: two warpgroups × the MMA's 64
constexpr int kGemmCols = 128;  // MMA columns (rows of W) of a sub-tile: the MMA's n
constexpr int kGemmK = 64;      // k of a stage: 128 bytes of 16-bit elements, the swizzle's row
constexpr int kGemmStages = 4;
constexpr int kGemmTileBytes = kGemmRows * kGemmK * 2;  // one operand of a stage: 16 KiB
constexpr int kGemmStageBytes = 2 * kGemmTileBytes;     // x's rows, then W's
// the launch's dynamic shared memory a GEMM needs (mpk.ops.linalg.GEMM_SMEM_BYTES): the stages
// and up to 1 KiB to align them to the swizzle's 1024-byte period
constexpr int kGemmSmemBytes = kGemmStages * kGemmStageBytes + 1024;
static_assert(kGemmRows * 8 == 4 * kThreadsPerTask, "a thread copies 4 chunks of each operand per stage");

// A wgmma shared-memory matrix descriptor of a K-major operand in the 128-byte swizzle, its first
// 8 rows at shared address `addr` (8-row groups 1024 bytes apart): start address >> 4 in bits
// 0–13, leading byte offset 1 (unused by swizzled K-major layouts) in 16–29, stride byte offset
// 1024 >> 4 in 32–45, base offset 0 (addr's group is 1024-aligned), swizzle mode 1 (128 B) in 62–63.
// A k step of 16 elements within the 128-byte row advances the start address by 32 bytes; the
// hardware applies the swizzle to the resulting address, as the copies did.
__host__ __device__ constexpr unsigned long long gmma_desc(unsigned addr) {
  return static_cast<unsigned long long>((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Where the copies put 16-byte chunk `chunk` (k 8·chunk … 8·chunk + 7 of the stage) of operand row
// `row` in its 1024-aligned tile: rows of 128 bytes, the chunk at chunk ^ (row % 8) (the swizzle
// the descriptors name; 8 threads copying a row's chunks also hit distinct banks).
__host__ __device__ constexpr int gemm_chunk_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Ties the accumulators to this point of the instruction stream: the compiler may not move their
// reads or writes across it (the wgmma writes them asynchronously, behind its asm statement).
__device__ __forceinline__ void fence_accumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The cp.async copies of a stage are generic-proxy writes; the wgmma reads shared memory through
// the async proxy. Each thread fences its landed copies before the barrier the MMAs follow.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#define MPK_WGMMA_D                                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "  \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "    \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MPK_WGMMA_OPERANDS                                                                                            \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),         \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),         \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),         \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),         \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),         \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (64 rows × 128 columns over the warpgroup, fp32) += A (64 × 16, descriptor da) · B (16 × 128,
// descriptor db; W's rows K-major), both operands 16-bit T. Accumulator i of lane (g, t) of the
// warpgroup's warp v is row 16v + g + 8·((i >> 1) & 1), column 8·(i >> 2) + 2t + (i & 1).
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma operands are bf16 or f16");
  // scale-d 1 (accumulate), scale-a and scale-b 1, neither operand transposed (both K-major)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MPK_WGMMA_D ", %64, %65, p, 1, 1, 0, 0;\n}"
                 : MPK_WGMMA_OPERANDS
                 : "l"(da), "l"(db), "r"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " MPK_WGMMA_D ", %64, %65, p, 1, 1, 0, 0;\n}"
                 : MPK_WGMMA_OPERANDS
                 : "l"(da), "l"(db), "r"(1));
  }
}
#undef MPK_WGMMA_D
#undef MPK_WGMMA_OPERANDS

// The tensor-core task of the matmul op and of matmul_partial (codegen names the instantiation):
// T the operands' type; kGlu the SiLU·mul epilogue; kPlanes the split-K partial form
// (mpk/ops/splitk.py); kEarlyW: W is a graph input (a weight, which no task writes), so the first
// sub-tile's first stages of W are requested before the task waits for its inputs (self-gated,
// as the decode linear).
//
// Inputs: x [M, K] and W as b = Wᵀ [K, N] (kGlu: [K, 2N], gate then up), both unit-stride along K
// with 16-byte aligned rows. Plain: optional input 2 the bias (T, at most 2-d, broadcast to the
// output), fparam[0] alpha, fparam[1] beta; kGlu: fparam[0] scales both halves; kPlanes: the
// output is P [S, M, N] in fp32, the tile's rect (slices, rows, columns), iparam[0] S and [1]
// the granule give each slice's K range (splitk.cuh: slice_bound), and P[s] = x[:, k_s] · Wᵀ[k_s]
// unscaled (matmul_finish adds the planes, scales and adds the bias). Inlined, as is the dispatch
// of a graph that uses it (GpuSpec.in_kernel): ptxas serializes warpgroup MMAs inside any
// function the kernel calls.
template <typename T, bool kGlu, bool kPlanes, bool kEarlyW>
__device__ __forceinline__ void gemm_task(const OpC& c, const Rect& r, const TaskEnv& env) {
  static_assert(!(kGlu && kPlanes), "a partial product has no epilogue");
  if constexpr (!kEarlyW) {
    if (!acquire_inputs(env)) return;
  }
  constexpr int kDtype = std::is_same_v<T, __nv_bfloat16> ? kBF16 : kF16;
  constexpr int kOutCols = kGlu ? kGemmCols / 2 : kGemmCols;  // output columns of a sub-tile
  constexpr int kRow = kPlanes ? 1 : 0;  // the rect's row dim (kPlanes: after the slices)
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const long long K = a.shape[1], M = c.out_shape[kRow], N = c.out_shape[kRow + 1];
  const T* x = static_cast<const T*>(env.buffers[a.buffer]) + a.offset;
  const T* w = static_cast<const T*>(env.buffers[b.buffer]) + b.offset;
  const long long lda = a.stride[0], ldw = b.stride[1];
  char* smem = reinterpret_cast<char*>(norm_tile());
  smem += (1024u - (static_cast<unsigned>(__cvta_generic_to_shared(smem)) & 1023u)) & 1023u;
  const unsigned smem_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = warp >> 2;
  // Copies: thread t moves 16-byte chunk t % 8 of rows t / 8 + 32i of each operand, 8 threads a
  // 128-byte row (coalesced); rows 32 apart share their swizzle.
  const int chunk = threadIdx.x & 7, row0 = threadIdx.x >> 3;
  char* const dst = smem + gemm_chunk_offset(row0, chunk);
  bool early = kEarlyW;  // this sub-tile's first stages of W went out before the gate

  const long long s_lo = kPlanes ? r.lo[0] : 0, s_hi = kPlanes ? r.hi[0] : 1;
  for (long long sl = s_lo; sl < s_hi; ++sl) {
    const long long k_lo = kPlanes ? slice_bound(K, c.iparam[0], c.iparam[1], sl) : 0;
    const long long k_hi = kPlanes ? slice_bound(K, c.iparam[0], c.iparam[1], sl + 1) : K;
    const int ksteps = static_cast<int>((k_hi - k_lo + kGemmK - 1) / kGemmK);
    for (long long m0 = r.lo[kRow]; m0 < r.hi[kRow]; m0 += kGemmRows) {
      for (long long n0 = r.lo[kRow + 1]; n0 < r.hi[kRow + 1]; n0 += kOutCols) {
        const long long m_end = min(m0 + kGemmRows, r.hi[kRow]), n_end = min(n0 + kOutCols, r.hi[kRow + 1]);
        // Thread t's rows of x: m0 + row0 + 32i (i < 4); of W: n0 + row0 + 32i (i < 4; kGlu: MMA
        // columns from kOutCols on are the up rows, N rows further). One base address and the
        // rows left each, rather than a pointer per row: fewer registers.
        const int a_left = static_cast<int>(m_end - m0) - row0, b_left = static_cast<int>(n_end - n0) - row0;
        const T* const base_a = x + (a_left > 0 ? (m0 + row0) * lda + k_lo : 0) + 8 * chunk;
        const T* const base_b = w + (b_left > 0 ? (n0 + row0) * ldw + k_lo : 0) + 8 * chunk;
        const auto k_in = [&](int ks) { return k_lo + static_cast<long long>(ks) * kGemmK + 8 * chunk < k_hi; };
        const auto load_x = [&](int ks) {
          char* s = dst + (ks % kGemmStages) * kGemmStageBytes;
          const bool kin = k_in(ks);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const bool ok = 32 * i < a_left && kin;
            cp_async16_or_zero(s + i * 32 * 128, ok ? base_a + 32 * i * lda + ks * kGemmK : x, ok);
          }
        };
        const auto load_w = [&](int ks) {
          char* s = dst + (ks % kGemmStages) * kGemmStageBytes + kGemmTileBytes;
          const bool kin = k_in(ks);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            constexpr int kGroups = kOutCols / 32;  // kGlu: row groups of gate, then as many of up
            const int j = kGlu ? i % kGroups : i;
            const bool ok = 32 * j < b_left && kin;
            const T* src = base_b + 32 * j * ldw + (kGlu && i >= kGroups ? N * ldw : 0) + ks * kGemmK;
            cp_async16_or_zero(s + i * 32 * 128, ok ? src : w, ok);
          }
        };
        float d[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) d[i] = 0.f;
        __syncthreads();  // both warpgroups' MMAs of the previous sub-tile are done with the stages
        if (early) {
#pragma unroll
          for (int s = 0; s < kGemmStages - 2; ++s)
            if (s < ksteps) load_w(s);
          if (!acquire_inputs(env)) {
            cp_async_wait_all();  // nothing may land in shared memory after the task returned
            return;
          }
        }
#pragma unroll
        for (int s = 0; s < kGemmStages - 2; ++s) {
          if (s < ksteps) {
            load_x(s);
            if (!early) load_w(s);
          }
          cp_async_commit();  // a group per step, empty or not: the waits below count them
        }
        early = false;
#pragma unroll 1
        for (int ks = 0; ks < ksteps; ++ks) {
          cp_async_wait_pending<kGemmStages - 3>();  // this thread's copies of step ks landed
          fence_proxy_async_shared();
          __syncthreads();  // everyone's copies of step ks landed; the MMAs of step ks − 2 are done
          if (ks + kGemmStages - 2 < ksteps) {  // into the stage step ks − 2 read
            load_x(ks + kGemmStages - 2);
            load_w(ks + kGemmStages - 2);
          }
          cp_async_commit();
          const unsigned stage = smem_addr + (ks % kGemmStages) * kGemmStageBytes;
          fence_accumulators(d);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kGemmK / 16; ++kk) {
            wgmma_m64n128k16<T>(d, gmma_desc(stage + group * (kGemmTileBytes / 2) + 32 * kk),
                                gmma_desc(stage + kGemmTileBytes + 32 * kk));
          }
          wgmma_commit();
          wgmma_wait<1>();  // step ks − 1's MMAs are done: its stage is refilled after the next barrier
          fence_accumulators(d);
        }
        wgmma_wait<0>();
        fence_accumulators(d);

        // Accumulator i holds, for lane (g, t) of warp v of warpgroup `group`, row
        // 64·group + 16v + g + 8·((i >> 1) & 1) and MMA column 8·(i >> 2) + 2t + (i & 1).
        // acc(q, h, e): MMA column 8q + 2t + e of row half h.
        const auto acc = [&](int q, int h, int e) -> float { return d[4 * q + 2 * h + e]; };
        void* const out = env.buffers[c.out_buffer];
        const float alpha = kPlanes ? 1.f : c.fparam[0], beta = kPlanes ? 0.f : c.fparam[1];
        // the bias (a decoder layer's residual): its element (row, col) at row·bs0 + col·bs1
        const T* bias = nullptr;
        long long bs0 = 0, bs1 = 0;
        if (!kGlu && !kPlanes && c.num_inputs > 2) {
          const ViewC& v = c.in[2];
          bias = static_cast<const T*>(env.buffers[v.buffer]) + v.offset;
          if (v.ndim >= 1) bs1 = v.shape[v.ndim - 1] == 1 ? 0 : v.stride[v.ndim - 1];
          if (v.ndim == 2) bs0 = v.shape[0] == 1 ? 0 : v.stride[0];
        }
        const long long row_lo = m0 + 64 * group + 16 * (warp & 3) + (lane >> 2);
        const int col_in = 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long row = row_lo + 8 * h;
          if (row >= m_end) continue;
#pragma unroll
          for (int q = 0; q < kOutCols / 8; ++q) {
            const long long col = n0 + 8 * q + col_in;
            float v[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if constexpr (kGlu) {  // the up column of the same output column: kOutCols MMA columns on
                const float gate = acc(q, h, e) * alpha, up = acc(q + kOutCols / 8, h, e) * alpha;
                v[e] = silu_times(round_to(kDtype, gate), round_to(kDtype, up), kDtype);
              } else {
                v[e] = acc(q, h, e) * alpha;
                if (bias != nullptr && col + e < n_end) v[e] += beta * to_f(bias[row * bs0 + (col + e) * bs1]);
              }
            }
            const long long at = (kPlanes ? sl * M + row : row) * N + col;
            const bool pair = col + 1 < n_end && at % 2 == 0;
            if constexpr (kPlanes) {
              float* o = static_cast<float*>(out) + at;
              if (pair) {
                *reinterpret_cast<float2*>(o) = make_float2(v[0], v[1]);
              } else {
                if (col < n_end) o[0] = v[0];
                if (col + 1 < n_end) o[1] = v[1];
              }
            } else {
              T* o = static_cast<T*>(out) + at;
              if (pair) {
                *reinterpret_cast<uint32_t*>(o) = pack2<T>(v[0], v[1]);
              } else {
                if (col < n_end) o[0] = from_f<T>(v[0]);
                if (col + 1 < n_end) o[1] = from_f<T>(v[1]);
              }
            }
          }
        }
      }
    }
  }
  if (early) {  // the rect held no sub-tile (no work): the gate still opens
    if (!acquire_inputs(env)) return;
  }
}

}  // namespace mpk

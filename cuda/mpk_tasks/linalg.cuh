// Task family: linear algebra. ``matmul`` (a [..., M, K] @ b [..., K, N] (+ bias), batch dims
// broadcast) in two variants — 1: the bandwidth-grade decode linear (tensor cores, weights
// streamed with 16-byte loads), picked by codegen when the views allow it; 0: the general
// one, one thread per output element — and ``embedding``.
#pragma once
#include "rows.cuh"  // rms_scale8: the RMSNorm prologue

namespace mpk {

constexpr int kLinRows = 16;     // rows (batch) a variant-1 tile may hold: the MMA's M
constexpr int kLinBlocks = 8;    // 8-column weight blocks per pass, at most: 64 columns
constexpr int kLinInFlight = 16; // 16-byte weight loads each lane keeps in flight
constexpr int kThreadsPerTask = 256;  // mpk_runtime/persistent.cuh: kThreads

// A 16-byte load that bypasses L1: weights are read exactly once. (An L2 evict-first hint on
// these loads measured no faster on H200 decode steps.)
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Variant 1: out [M, N] = alpha·x [M, K]·W [N, K]ᵀ (+ beta·bias), x and W bf16 with unit stride
// along K, 16-byte aligned rows, K % 32 == 0, at most 16 rows per tile (codegen checks all of
// it). One m16n8k16 MMA takes the tile's rows (zero-padded to 16) against 8 weight rows. A
// lane loads 8 consecutive k of one weight row in one 16-byte load; the dot product does not
// care about the order of k, so the A fragment is loaded with the same k permutation and no
// shuffle is needed. The 8 warps split K (every 8th 32-wide step), each with
// kLinInFlight loads in flight (kBlocks blocks × kLinInFlight / kBlocks k steps: a tile of few
// columns goes deeper along K); their partial sums meet in shared memory and are added in warp
// order (deterministic), then the epilogue scales, adds the bias (the residual of a decoder
// layer) and stores.
// kNorm: the rms_matmul op — input 2 is an RMSNorm weight over K, applied to x as a prologue
// (each task computes its rows' rstd; fparam[2] is eps).
template <int kBlocks, bool kNorm>
__device__ __noinline__ void linear_bf16(const OpC& c, const Rect& r, const TaskEnv& env) {
  constexpr int kLinUnroll = kLinInFlight / kBlocks;
  const ViewC& a = c.in[0];
  const ViewC& b = c.in[1];
  const long long K = a.shape[1], N = c.out_shape[1];
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(env.buffers[a.buffer]) + a.offset;
  const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(env.buffers[b.buffer]) + b.offset;
  const long long lda = a.stride[0], ldw = b.stride[1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long m0 = r.lo[0];
  const int rows = static_cast<int>(r.hi[0] - m0), ksteps = static_cast<int>(K / 32);
  const bool has_lo = g < rows, has_hi = g + 8 < rows;
  const __nv_bfloat16* x_lo = x + (m0 + g) * lda + 8 * t;
  const __nv_bfloat16* x_hi = x + (m0 + g + 8) * lda + 8 * t;
  float* red = scratch();  // [warp][64 columns][16 rows]
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float rstd_lo = 0.f, rstd_hi = 0.f;
  const __nv_bfloat16* wn = nullptr;
  if constexpr (kNorm) {
    const ViewC& nw = c.in[2];
    wn = static_cast<const __nv_bfloat16*>(env.buffers[nw.buffer]) + nw.offset + 8 * t;
    for (int row = warp; row < rows; row += warps) {
      const auto* xr = reinterpret_cast<const uint4*>(x + (m0 + row) * lda);
      float ss = 0.f;
      for (long long j = lane; j < K / 8; j += 32) {
        const uint4 v = __ldcg(xr + j);
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(h[e]);
          ss += f.x * f.x + f.y * f.y;
        }
      }
      ss = warp_sum(ss);
      if (lane == 0) red[row] = rsqrtf(ss / K + c.fparam[2]);
    }
    __syncthreads();
    rstd_lo = has_lo ? red[g] : 0.f;
    rstd_hi = has_hi ? red[g + 8] : 0.f;
    __syncthreads();  // red is reused by the reduction below
  }
  // the bias (a decoder layer's residual): bf16, broadcast by zero strides (codegen checks)
  const __nv_bfloat16* bias = nullptr;
  long long bs0 = 0, bs1 = 0;
  if (!kNorm && c.num_inputs > 2) {
    const ViewC& v = c.in[2];
    bias = static_cast<const __nv_bfloat16*>(env.buffers[v.buffer]) + v.offset;
    if (v.ndim >= 1) bs1 = v.shape[v.ndim - 1] == 1 ? 0 : v.stride[v.ndim - 1];
    if (v.ndim == 2) bs0 = v.shape[0] == 1 ? 0 : v.stride[0];
  }
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(env.buffers[c.out_buffer]);
  constexpr int kPerThread = kLinRows * 8 * kBlocks / kThreadsPerTask;  // epilogue outputs per thread
  for (long long n0 = r.lo[1]; n0 < r.hi[1]; n0 += 8 * kBlocks) {
    const int cols = static_cast<int>(min(8LL * kBlocks, r.hi[1] - n0));
    // the pass's bias values, loaded now: they arrive while the weights stream
    float bv[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreadsPerTask;
      bv[j] = bias && e < rows * cols ? __bfloat162float(bias[(m0 + e / cols) * bs0 + (n0 + e % cols) * bs1]) : 0.f;
    }
    float acc[kBlocks][4];
    const __nv_bfloat16* wrow[kBlocks];
    bool valid[kBlocks];
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) {
      const long long n = n0 + 8 * j + g;
      valid[j] = n < r.hi[1];
      wrow[j] = w + n * ldw + 8 * t;
      acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    }
    for (int ks = warp; ks < ksteps; ks += warps * kLinUnroll) {
      uint4 wv[kLinUnroll][kBlocks], lo[kLinUnroll], hi[kLinUnroll];
#pragma unroll
      for (int u = 0; u < kLinUnroll; ++u) {
        const int k = ks + u * warps;
        const bool ok = k < ksteps;
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) wv[u][j] = ok && valid[j] ? ld_stream(wrow[j] + 32LL * k) : zero;
        // activations are written inside the kernel: coherent (L2) loads, not the read-only path
        lo[u] = ok && has_lo ? __ldcg(reinterpret_cast<const uint4*>(x_lo + 32LL * k)) : zero;
        hi[u] = ok && has_hi ? __ldcg(reinterpret_cast<const uint4*>(x_hi + 32LL * k)) : zero;
        if constexpr (kNorm) {
          if (ok) {
            const uint4 wk = __ldg(reinterpret_cast<const uint4*>(wn + 32LL * k));
            if (has_lo) lo[u] = rms_scale8(lo[u], wk, rstd_lo);
            if (has_hi) hi[u] = rms_scale8(hi[u], wk, rstd_hi);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kLinUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
          mma_bf16(acc[j], lo[u].x, hi[u].x, lo[u].y, hi[u].y, wv[u][j].x, wv[u][j].y);
          mma_bf16(acc[j], lo[u].z, hi[u].z, lo[u].w, hi[u].w, wv[u][j].z, wv[u][j].w);
        }
      }
    }
    // accumulator fragment: rows g and g + 8, columns 2t and 2t + 1 of each 8-column block
#pragma unroll
    for (int j = 0; j < kBlocks; ++j) {
      float* p = red + (warp * 64 + 8 * j + 2 * t) * kLinRows;
      p[g] = acc[j][0];
      p[kLinRows + g] = acc[j][1];
      p[g + 8] = acc[j][2];
      p[kLinRows + g + 8] = acc[j][3];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int e = threadIdx.x + j * kThreadsPerTask;
      if (e >= rows * cols) break;
      const int row = e / cols, col = e % cols;
      float s = 0.f;
      for (int v = 0; v < warps; ++v) s += red[(v * 64 + col) * kLinRows + row];
      out[(m0 + row) * N + n0 + col] = __float2bfloat16(s * c.fparam[0] + c.fparam[1] * bv[j]);
    }
    __syncthreads();
  }
}

template <bool kNorm>
__device__ __forceinline__ void linear_variant1(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long cols = r.hi[1] - r.lo[1];
  if (cols <= 16) linear_bf16<2, kNorm>(c, r, env);
  else if (cols <= 32) linear_bf16<4, kNorm>(c, r, env);
  else linear_bf16<kLinBlocks, kNorm>(c, r, env);
}

// rms_matmul: out = rms_norm(x, w) @ b; inputs x [M, K], b [K, N], w [K]; fparam[2] eps,
// iparam[0] the norm's dtype code. Variant 0 (general views) normalises per output element.
__device__ void task_rms_matmul(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (c.variant == 1) {
    linear_variant1<true>(c, r, env);
    return;
  }
  const ViewC &a = c.in[0], &b = c.in[1], &w = c.in[2];
  const long long kdim = a.shape[1];
  const long long n = rect_numel(r, 2);
  const int norm_dtype = static_cast<int>(c.iparam[0]);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, 2, e, idx);
    long long ia[2] = {idx[0], 0}, ib[2] = {0, idx[1]}, iw[1] = {0};
    float ss = 0.f;
    for (long long k = 0; k < kdim; ++k) {
      ia[1] = k;
      const float v = load_f(env.buffers[a.buffer], a.dtype, view_index(a, ia, 2));
      ss += v * v;
    }
    const float rstd = rsqrtf(ss / kdim + c.fparam[2]);
    float acc = 0.f;
    for (long long k = 0; k < kdim; ++k) {
      ia[1] = ib[0] = iw[0] = k;
      const float xn = round_to(norm_dtype, load_f(env.buffers[a.buffer], a.dtype, view_index(a, ia, 2)) * rstd);
      const float h = round_to(c.out_dtype, xn * load_f(env.buffers[w.buffer], w.dtype, view_index(w, iw, 1)));
      acc += h * load_f(env.buffers[b.buffer], b.dtype, view_index(b, ib, 2));
    }
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, 2), acc);
  }
}

// fparam[0] alpha, fparam[1] beta; optional input 2 is the bias (broadcast to the output).
__device__ void task_matmul(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (c.variant == 1) {
    linear_variant1<false>(c, r, env);
    return;
  }
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

// out[..., d] = weight[ids[...], d]; inputs weight [V, D], ids.
__device__ void task_embedding(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC& w = c.in[0];
  const ViewC& ids = c.in[1];
  const long long n = rect_numel(r, c.ndim);
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    const long long tok = load_i(env.buffers[ids.buffer], ids.dtype, view_index(ids, idx, c.ndim - 1));
    long long widx[2] = {tok, idx[c.ndim - 1]};
    const float v = load_f(env.buffers[w.buffer], w.dtype, view_index(w, widx, 2));
    store_f(env.buffers[c.out_buffer], c.out_dtype, ravel(idx, c.out_shape, c.ndim), v);
  }
}

}  // namespace mpk

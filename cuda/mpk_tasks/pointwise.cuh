// Task family: elementwise. ``pointwise`` (one function of tensor inputs and constants, with
// broadcasting) and ``silu_mul``. Every thread of the CTA takes elements of the tile in turn.
#pragma once
#include "common.cuh"

namespace mpk {

// Function ids: the order of mpk.ops.pointwise.POINTWISE_FNS.
enum PointwiseFn : int { kAdd, kSub, kMul, kDiv, kPow, kNeg, kExp, kRsqrt, kSqrt, kSilu, kGelu, kGeluTanh,
                         kSigmoid, kTanh, kRelu, kCast };

__device__ __forceinline__ float apply_pointwise(int fn, float a, float b) {
  switch (fn) {
    case kAdd: return a + b;
    case kSub: return a - b;
    case kMul: return a * b;
    case kDiv: return a / b;
    case kPow: return b == 2.f ? a * a : powf(a, b);
    case kNeg: return -a;
    case kExp: return expf(a);
    case kRsqrt: return rsqrtf(a);
    case kSqrt: return sqrtf(a);
    case kSilu: return a / (1.f + expf(-a));
    case kGelu: return 0.5f * a * (1.f + erff(a * 0.70710678118654752f));
    case kGeluTanh: return 0.5f * a * (1.f + tanhf(0.79788456080286536f * (a + 0.044715f * a * a * a)));
    case kSigmoid: return 1.f / (1.f + expf(-a));
    case kTanh: return tanhf(a);
    case kRelu: return a > 0.f ? a : 0.f;
    default: return a;  // kCast: the store converts
  }
}

// operand j: iparam[j] >= 0 names an input, -1 a constant fparam[j]; iparam[7] = arity.
__device__ void task_pointwise(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  const int arity = static_cast<int>(c.iparam[7]);
  for (long long k = threadIdx.x; k < n; k += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, k, idx);
    float x[2] = {0.f, 0.f};
    for (int j = 0; j < arity; ++j) {
      const int in = static_cast<int>(c.iparam[j]);
      if (in < 0) {
        x[j] = c.fparam[j];
      } else {
        const ViewC& v = c.in[in];
        x[j] = load_f(env.buffers[v.buffer], v.dtype, view_index(v, idx, c.ndim));
      }
    }
    store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), apply_pointwise(c.variant, x[0], x[1]));
  }
}

// silu(g)·u with silu rounded to g's dtype first (what F.silu(g) * u does in that dtype).
__device__ __forceinline__ float silu_times(float g, float u, int dtype) {
  return round_to(dtype, g / (1.f + __expf(-g))) * u;
}

// Variant 1 (codegen: silu_mul_variant): 2-d bf16 gate, up and output rows with unit stride,
// 16-byte aligned, tile columns in multiples of 8 — decode's [B, I] case: one 16-byte load of
// each operand per 8 outputs, all of a thread's loads in flight at once.
__device__ void silu_mul_bf16(const OpC& c, const Rect& r, const TaskEnv& env) {
  const ViewC &g = c.in[0], &u = c.in[1];
  const int vecs = static_cast<int>(r.hi[1] - r.lo[1]) / 8, n = static_cast<int>(r.hi[0] - r.lo[0]) * vecs;
  const auto* gp = static_cast<const __nv_bfloat16*>(env.buffers[g.buffer]) + g.offset;
  const auto* up = static_cast<const __nv_bfloat16*>(env.buffers[u.buffer]) + u.offset;
  auto* out = static_cast<__nv_bfloat16*>(env.buffers[c.out_buffer]);
  for (int e = threadIdx.x; e < n; e += blockDim.x) {
    const long long row = r.lo[0] + e / vecs, col = r.lo[1] + 8LL * (e % vecs);
    // activations are written inside the kernel: coherent (L2) loads
    const uint4 gv = __ldcg(reinterpret_cast<const uint4*>(gp + row * g.stride[0] + col));
    const uint4 uv = __ldcg(reinterpret_cast<const uint4*>(up + row * u.stride[0] + col));
    const uint4 o = zip_bf16x8(gv, uv, [](float a, float b) { return silu_times(a, b, kBF16); });
    *reinterpret_cast<uint4*>(out + row * c.out_shape[1] + col) = o;
  }
}

__device__ void task_silu_mul(const OpC& c, const Rect& r, const TaskEnv& env) {
  if (c.variant == 1) {
    silu_mul_bf16(c, r, env);
    return;
  }
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  for (long long k = threadIdx.x; k < n; k += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, k, idx);
    const float g = load_f(env.buffers[c.in[0].buffer], c.in[0].dtype, view_index(c.in[0], idx, c.ndim));
    const float u = load_f(env.buffers[c.in[1].buffer], c.in[1].dtype, view_index(c.in[1], idx, c.ndim));
    store_f(out, c.out_dtype, ravel(idx, c.out_shape, c.ndim), silu_times(g, u, c.in[0].dtype));
  }
}

}  // namespace mpk

// Task family: elementwise. ``pointwise`` (one function of tensor inputs and constants, with
// broadcasting) and ``silu_mul``. Every thread of the CTA takes elements of the tile in turn.
#pragma once
#include "common.cuh"

namespace mpk {

// Function ids: the order of mpk.ops.pointwise.POINTWISE_FNS.
enum PointwiseFn : int {
  kAdd, kSub, kMul, kDiv, kPow, kNeg, kExp, kRsqrt, kSqrt, kSilu, kGelu, kGeluTanh, kSigmoid, kTanh, kRelu, kCast,
  kAbs, kLog, kSin, kCos, kReciprocal, kErf, kLog1p, kExpm1, kFloor, kCeil, kRound, kTrunc, kSign,
  kMaximum, kMinimum, kClamp, kEq, kNe, kLt, kLe, kGt, kGe, kWhere,
  kLogicalAnd, kLogicalOr, kLogicalXor, kLogicalNot, kBitwiseAnd, kBitwiseOr, kBitwiseXor, kBitwiseNot,
  kLeakyRelu, kElu, kSoftplus, kHardsigmoid, kHardswish, kMish, kGlu, kLogSigmoid, kThreshold, kArange
};

// torch.minimum's NaN rule (max_nan in common.cuh is torch.maximum's)
template <typename T>
__device__ __forceinline__ T min_nan(T a, T b) {
  return (a != a || b != b) ? (a != a ? a : b) : fmin(a, b);
}

// relu6(x + 3), the ramp of hardsigmoid and hardswish (NaN stays NaN, as in torch)
template <typename T>
__device__ __forceinline__ T relu6_plus3(T a) { return min_nan(max_nan(a + T(3), T(0)), T(6)); }

// The functions whose form is the same for every element type of apply_pointwise.
template <typename T>
__device__ __forceinline__ bool apply_common(int fn, T a, T b, T c, T& out) {
  switch (fn) {
    case kAdd: out = a + b; return true;
    case kSub: out = a - b; return true;
    case kMul: out = a * b; return true;
    case kNeg: out = -a; return true;
    case kSign: out = static_cast<T>((a > T(0)) - (a < T(0))); return true;  // torch: sign(NaN) = 0
    case kEq: out = a == b; return true;
    case kNe: out = a != b; return true;
    case kLt: out = a < b; return true;
    case kLe: out = a <= b; return true;
    case kGt: out = a > b; return true;
    case kGe: out = a >= b; return true;
    case kWhere: out = a != T(0) ? b : c; return true;
    case kLogicalAnd: out = (a != T(0)) && (b != T(0)); return true;
    case kLogicalOr: out = (a != T(0)) || (b != T(0)); return true;
    case kLogicalXor: out = (a != T(0)) != (b != T(0)); return true;
    case kLogicalNot: out = a == T(0); return true;
    default: return false;
  }
}

// One element of ``fn``. T = float: what eager PyTorch computes for float32/16 and bfloat16
// operands before the store rounds; T = double: float64 results and operands, in double as
// torch computes them (the math functions' overloads pick expf or exp by T); T = long long:
// integer and bool results of integer operands, exact as torch's (through float32 an int64
// above 2^24 would round). mpk.ops.pointwise.INT_FNS lists the functions the integer form takes.
template <typename T>
__device__ __forceinline__ T apply_pointwise(int fn, T a, T b, T c, T extra) {
  T out;
  if (apply_common(fn, a, b, c, out)) return out;
  if constexpr (std::is_same_v<T, long long>) {
    switch (fn) {
      case kPow: {  // a negative power: 1 / a^|b| truncated, as torch does for integer tensors
        if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
        long long r = 1;
        for (; b > 0; b >>= 1, a *= a)
          if (b & 1) r *= a;
        return r;
      }
      case kRelu: return a > 0 ? a : 0;
      case kAbs: return a < 0 ? -a : a;
      case kMaximum: return a > b ? a : b;
      case kMinimum: return a < b ? a : b;
      case kClamp: return (a > b ? a : b) < c ? (a > b ? a : b) : c;
      case kBitwiseAnd: return a & b;
      case kBitwiseOr: return a | b;
      case kBitwiseXor: return a ^ b;
      case kBitwiseNot: return ~a;
      default: return a;  // kCast, kArange, kFloor, kCeil, kRound, kTrunc: integers are their own rounding
    }
  } else {
    const T one(1), zero(0);
    switch (fn) {
      case kDiv: return a / b;
      case kPow: return b == T(2) ? a * a : pow(a, b);
      case kExp: return exp(a);
      case kRsqrt: return rsqrt(a);
      case kSqrt: return sqrt(a);
      case kSilu: return a / (one + exp(-a));
      case kGelu: return T(0.5) * a * (one + erf(a * T(0.70710678118654752)));
      case kGeluTanh: return T(0.5) * a * (one + tanh(T(0.79788456080286536) * (a + T(0.044715) * a * a * a)));
      case kSigmoid: return one / (one + exp(-a));
      case kTanh: return tanh(a);
      case kRelu: return a < zero ? zero : a;  // NaN and -0 stay, as torch's clamp_min(x, 0)
      case kAbs: return fabs(a);
      case kLog: return log(a);
      case kSin: return sin(a);
      case kCos: return cos(a);
      case kReciprocal: return one / a;
      case kErf: return erf(a);
      case kLog1p: return log1p(a);
      case kExpm1: return expm1(a);
      case kFloor: return floor(a);
      case kCeil: return ceil(a);
      case kRound: return rint(a);  // halves to even, as torch.round
      case kTrunc: return trunc(a);
      case kMaximum: return max_nan(a, b);
      case kMinimum: return min_nan(a, b);
      case kClamp: return min_nan(max_nan(a, b), c);  // lo > hi gives hi, as torch.clamp
      case kLeakyRelu: return a > zero ? a : a * b;
      case kElu: return a > zero ? a * c : expm1(a * extra) * (b * c);  // b α, c scale, extra input scale (torch's order)
      case kSoftplus: return a * b > c ? a : log1p(exp(a * b)) / b;  // b beta, c threshold
      // times float(1/6), as torch (whose float64 form keeps that float constant too)
      case kHardsigmoid: return relu6_plus3(a) * T(1.f / 6.f);
      case kHardswish: return a * relu6_plus3(a) * T(1.f / 6.f);
      case kMish: return a * tanh(log1p(exp(a)));
      case kGlu: return a * (one / (one + exp(-b)));  // a · sigmoid(b)
      case kLogSigmoid: return fmin(a, zero) - log1p(exp(-fabs(a)));  // no overflow for large |a|
      case kThreshold: return a <= b ? c : a;  // NaN stays
      default: return a;  // kCast (and kArange, already counted): the store converts
    }
  }
}

// The pointwise task, instantiated per element type T (codegen: _pointwise_task — a graph
// compiles only the forms its ops use). iparam[3] = arity | function << 8 (PointwiseFn), iparam[4]
// the function's extra constant (its float64 bits). Operand j < arity (at most 3): iparam[j] >= 0
// names an input, -1 a constant — fparam[j] for float, iparam[5 + j] for long long (the value)
// and double (its IEEE bits).
template <typename T>
__device__ void pointwise_tile(const OpC& c, const Rect& r, const TaskEnv& env) {
  const long long n = rect_numel(r, c.ndim);
  void* out = env.buffers[c.out_buffer];
  const int arity = static_cast<int>(c.iparam[3] & 0xff), fn = static_cast<int>(c.iparam[3] >> 8);
  const T extra = static_cast<T>(__longlong_as_double(c.iparam[4]));
  T k[3];
  for (int j = 0; j < 3; ++j) {
    if constexpr (std::is_same_v<T, float>) k[j] = c.fparam[j];
    else if constexpr (std::is_same_v<T, double>) k[j] = __longlong_as_double(c.iparam[5 + j]);
    else k[j] = c.iparam[5 + j];
  }
  for (long long e = threadIdx.x; e < n; e += blockDim.x) {
    long long idx[kMaxDims];
    rect_unravel(r, c.ndim, e, idx);
    T x[3] = {0, 0, 0};
    for (int j = 0; j < arity; ++j) {
      const int in = static_cast<int>(c.iparam[j]);
      if (in < 0) {
        x[j] = k[j];
        continue;
      }
      const ViewC& v = c.in[in];
      x[j] = load_as<T>(env.buffers[v.buffer], v.dtype, view_index(v, idx, c.ndim));
    }
    const long long o = ravel(idx, c.out_shape, c.ndim);
    if (fn == kArange) x[0] += x[1] * static_cast<T>(idx[0]);  // start + step · i (1-d), then kCast's store
    const T y = apply_pointwise<T>(fn, x[0], x[1], x[2], extra);
    store_as(out, c.out_dtype, o, y);
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

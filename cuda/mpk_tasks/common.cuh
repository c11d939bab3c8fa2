// Shared by every task family: per-op constants (generated from the tables), strided views,
// dtype-generic loads/stores, and the tile → element index arithmetic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "mpk_runtime/types.cuh"  // the status rows' layout, which the tasks' own waits write too

namespace mpk {

constexpr int kMaxDims = 8;
// Input views an op's constants hold: 8, or more where the generated source says so for its
// graph (mpk.executors.codegen: WIDE_INPUTS), so that other graphs keep the smaller constants.
#ifndef MPK_MAX_INPUTS
#define MPK_MAX_INPUTS 8
#endif
constexpr int kMaxInputs = MPK_MAX_INPUTS;

// dtype codes: the order of mpk.compiler.tables.DTYPES
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3, kI64 = 4, kI32 = 5, kI16 = 6, kI8 = 7, kU8 = 8, kBool = 9 };

// A strided view of a buffer (tables: VIEW_DTYPE), resolved to its buffer's dtype.
struct ViewC {
  int buffer;
  int dtype;
  int ndim;
  long long offset;
  long long shape[kMaxDims];
  long long stride[kMaxDims];
};

// One op's constants (tables: OP_DTYPE + attrs), emitted by mpk/executors/codegen.py.
struct alignas(16) OpC {
  int type;      // registry type_id
  int variant;   // kind-specific (pointwise fn, reduce fn, …)
  int out_buffer;
  int out_dtype;
  int ndim;
  long long out_shape[kMaxDims];
  int grid[kMaxDims];
  // grid[d]'s divisor (fast_div): the tile's position and bounds are quotients by it on every
  // task's way in, where a division's long chain of dependent instructions would delay every task
  unsigned grid_magic[kMaxDims];
  int grid_shift[kMaxDims];
  int num_inputs;
  ViewC in[kMaxInputs];
  long long iparam[8];
  float fparam[4];
};

struct Rect {
  long long lo[kMaxDims];
  long long hi[kMaxDims];
};

__device__ __forceinline__ float load_f(const void* base, int dtype, long long i) {
  switch (dtype) {
    case kF32: return static_cast<const float*>(base)[i];
    case kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    case kI64: return static_cast<float>(static_cast<const long long*>(base)[i]);
    case kI32: return static_cast<float>(static_cast<const int*>(base)[i]);
    case kI16: return static_cast<float>(static_cast<const short*>(base)[i]);
    case kI8: return static_cast<float>(static_cast<const signed char*>(base)[i]);
    case kU8: return static_cast<float>(static_cast<const unsigned char*>(base)[i]);
    default: return static_cast<const bool*>(base)[i] ? 1.f : 0.f;
  }
}

__device__ __forceinline__ long long load_i(const void* base, int dtype, long long i) {
  switch (dtype) {
    case kI64: return static_cast<const long long*>(base)[i];
    case kI32: return static_cast<const int*>(base)[i];
    case kI16: return static_cast<const short*>(base)[i];
    case kI8: return static_cast<const signed char*>(base)[i];
    case kU8: return static_cast<const unsigned char*>(base)[i];
    case kBool: return static_cast<const bool*>(base)[i];
    default: return static_cast<long long>(load_f(base, dtype, i));
  }
}

// A float or double value into any dtype, as a C++ cast does on the GPU (what torch's CUDA casts
// do): integer types truncate (saturating at their range), 16-bit floats round from float.
template <typename V>
__device__ __forceinline__ void store_f(void* base, int dtype, long long i, V v) {
  static_assert(std::is_floating_point_v<V>, "store_f takes float or double");
  switch (dtype) {
    case kF32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case kF16: static_cast<__half*>(base)[i] = __float2half(static_cast<float>(v)); break;
    case kBF16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16(static_cast<float>(v)); break;
    case kF64: static_cast<double*>(base)[i] = v; break;
    case kI64: static_cast<long long*>(base)[i] = static_cast<long long>(v); break;
    case kI32: static_cast<int*>(base)[i] = static_cast<int>(v); break;
    case kI16: static_cast<short*>(base)[i] = static_cast<short>(v); break;
    case kI8: static_cast<signed char*>(base)[i] = static_cast<signed char>(v); break;
    case kU8: static_cast<unsigned char*>(base)[i] = static_cast<unsigned char>(v); break;
    default: static_cast<bool*>(base)[i] = v != V(0); break;
  }
}

// An integer into any dtype: integer types keep its low bits (torch's wrap-around), exactly.
__device__ __forceinline__ void store_i(void* base, int dtype, long long i, long long v) {
  switch (dtype) {
    case kI64: static_cast<long long*>(base)[i] = v; break;
    case kI32: static_cast<int*>(base)[i] = static_cast<int>(v); break;
    case kI16: static_cast<short*>(base)[i] = static_cast<short>(v); break;
    case kI8: static_cast<signed char*>(base)[i] = static_cast<signed char>(v); break;
    case kU8: static_cast<unsigned char*>(base)[i] = static_cast<unsigned char>(v); break;
    case kBool: static_cast<bool*>(base)[i] = v != 0; break;
    case kF64: store_f(base, dtype, i, static_cast<double>(v)); break;
    default: store_f(base, dtype, i, static_cast<float>(v));
  }
}

__device__ __forceinline__ bool is_int(int dtype) { return dtype >= kI64 && dtype <= kU8; }

// float64 elements and what meets them, in double (store_f takes the double back): float64
// tensors keep their precision, and int64 values up to 2^53 convert exactly (through float32
// both round at 2^24).
__device__ __forceinline__ double load_d(const void* base, int dtype, long long i) {
  if (dtype == kF64) return static_cast<const double*>(base)[i];
  if (is_int(dtype) || dtype == kBool) return static_cast<double>(load_i(base, dtype, i));
  return load_f(base, dtype, i);
}

// An element as T, for tasks templated on their arithmetic: float (load_f), double (load_d) or
// long long (load_i: integers exactly); store_as writes T back into any dtype.
template <typename T>
__device__ __forceinline__ T load_as(const void* base, int dtype, long long i) {
  if constexpr (std::is_same_v<T, long long>) return load_i(base, dtype, i);
  else if constexpr (std::is_same_v<T, double>) return load_d(base, dtype, i);
  else return load_f(base, dtype, i);
}

template <typename T>
__device__ __forceinline__ void store_as(void* base, int dtype, long long i, T v) {
  if constexpr (std::is_same_v<T, long long>) store_i(base, dtype, i, v);
  else store_f(base, dtype, i, v);
}

// Copy one element between dtypes; integer to integer stays exact (no float round trip), and
// float64 on either side goes through double.
__device__ __forceinline__ void move_elem(const void* src, int sdt, long long si, void* dst, int ddt, long long di) {
  if (is_int(sdt) && is_int(ddt)) store_i(dst, ddt, di, load_i(src, sdt, si));
  else if (sdt == kF64 || ddt == kF64) store_f(dst, ddt, di, load_d(src, sdt, si));
  else store_f(dst, ddt, di, load_f(src, sdt, si));
}

// Round a float through a storage dtype (what a cast to that dtype and back does).
__device__ __forceinline__ float round_to(int dtype, float v) {
  if (dtype == kBF16) return __bfloat162float(__float2bfloat16(v));
  if (dtype == kF16) return __half2float(__float2half(v));
  return v;
}

// Typed element access for tasks specialised to one dtype (float, __half or __nv_bfloat16):
// no per-element dtype switch, so the code stays short and loads can be vectorised.
template <typename T>
__device__ __forceinline__ float to_f(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return v;
}

template <typename T>
__device__ __forceinline__ T from_f(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(v);
  else if constexpr (std::is_same_v<T, __half>) return __float2half(v);
  else return v;
}

template <typename T>
__device__ __forceinline__ float round_as(float v) { return to_f(from_f<T>(v)); }

// kN consecutive elements at p (aligned to their total size, at least 4 bytes) as floats, in
// the widest loads that size allows.
template <int kN, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(T));
  static_assert(kBytes % 4 == 0, "load_vec reads whole 4-byte words");
  using W = std::conditional_t<kBytes % 16 == 0, uint4, std::conditional_t<kBytes % 8 == 0, uint2, uint32_t>>;
  W raw[kBytes / sizeof(W)];
#pragma unroll
  for (int i = 0; i < static_cast<int>(kBytes / sizeof(W)); ++i) raw[i] = reinterpret_cast<const W*>(p)[i];
  const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < kN; ++i) out[i] = to_f(e[i]);
}

// kN floats to consecutive elements of T at p (aligned to their total size, at least 4 bytes),
// in the widest stores that size allows: load_vec's mirror.
template <int kN, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[kN]) {
  constexpr int kBytes = kN * static_cast<int>(sizeof(T));
  static_assert(kBytes % 4 == 0, "store_vec writes whole 4-byte words");
  using W = std::conditional_t<kBytes % 16 == 0, uint4, std::conditional_t<kBytes % 8 == 0, uint2, uint32_t>>;
  W raw[kBytes / sizeof(W)];
  T* e = reinterpret_cast<T*>(raw);
#pragma unroll
  for (int i = 0; i < kN; ++i) e[i] = from_f<T>(v[i]);
#pragma unroll
  for (int i = 0; i < static_cast<int>(kBytes / sizeof(W)); ++i) reinterpret_cast<W*>(p)[i] = raw[i];
}

// Σ v² over the 8 bf16 elements of a 16-byte word, in fp32.
__device__ __forceinline__ float sum_squares8(uint4 a) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&a);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    s += f.x * f.x + f.y * f.y;
  }
  return s;
}

// f applied to the 8 bf16 pairs of two 16-byte words (as floats), rounded back to bf16.
template <typename F>
__device__ __forceinline__ uint4 zip_bf16x8(uint4 a, uint4 b, F f) {
  const auto* ah = reinterpret_cast<const __nv_bfloat162*>(&a);
  const auto* bh = reinterpret_cast<const __nv_bfloat162*>(&b);
  uint4 o;
  auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 x = __bfloat1622float2(ah[e]), y = __bfloat1622float2(bh[e]);
    oh[e] = __floats2bfloat162_rn(f(x.x, y.x), f(x.y, y.y));
  }
  return o;
}

// Element index of a view at a multi-index; dims of size 1 broadcast (index ignored), and a
// view of lower rank than the index is right-aligned against it (numpy broadcasting).
__device__ __forceinline__ long long view_index(const ViewC& v, const long long* idx, int idx_ndim) {
  long long off = v.offset;
  const int lead = idx_ndim - v.ndim;
  for (int d = 0; d < v.ndim; ++d) {
    const long long i = v.shape[d] == 1 ? 0 : idx[lead + d];
    off += i * v.stride[d];
  }
  return off;
}

// The global nanosecond timer (profiler stamps, busy waits, phase timing).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// i·n / g for extents whose product needs 64 bits: a slow subroutine, kept out of line so the
// common path's code stays short.
__device__ __noinline__ long long split_point64(unsigned long long i, unsigned long long n, unsigned long long g) {
  return static_cast<long long>(i * n / g);
}

// x / g for any 32-bit x, by g's magic multiplier m and shift s (mpk.executors.codegen.
// fast_divisor: m = ⌊2³²·(2ˢ − g) / g⌋ + 1 with s = ⌈log2 g⌉, Granlund and Montgomery's
// round-up method): a multiply-high, an add and a shift. (Host code too, for its CPU test.)
__host__ __device__ __forceinline__ unsigned fast_div(unsigned x, unsigned m, int s) {
#ifdef __CUDA_ARCH__
  const unsigned long long hi = __umulhi(x, m);  // ptxas fuses it with the add: IMAD.HI with carry
#else
  const unsigned long long hi = (static_cast<unsigned long long>(x) * m) >> 32;
#endif
  return static_cast<unsigned>((hi + x) >> s);
}

// Tile rect of ``tile`` for op ``c`` (row-major over its grid). Tiles are the balanced split
// of mpk.compiler.partition.split_bounds: boundary i of a dim of extent n in g parts is
// i·n / g (codegen checks the tables agree), so no boundary table is read on the hot path.
// Not unrolled: every task runs this, and short code is fetched faster. Written into the
// caller's Rect, not returned: ptxas copies a returned Rect field by field through local
// memory on every task's way in.
__device__ __forceinline__ void tile_rect(const OpC& c, int tile, Rect& r) {
#pragma unroll 1
  for (int d = c.ndim - 1; d >= 0; --d) {
    const unsigned g = static_cast<unsigned>(c.grid[d]), m = c.grid_magic[d];
    const int s = c.grid_shift[d];
    const unsigned q = fast_div(static_cast<unsigned>(tile), m, s), i = static_cast<unsigned>(tile) - q * g;
    tile = static_cast<int>(q);
    const unsigned long long n = static_cast<unsigned long long>(c.out_shape[d]);
    if (n * g < (1ULL << 32)) {  // the common case: 32-bit numerators
      r.lo[d] = fast_div(static_cast<unsigned>(i * n), m, s);
      r.hi[d] = fast_div(static_cast<unsigned>((i + 1) * n), m, s);
    } else {
      r.lo[d] = split_point64(i, n, g);
      r.hi[d] = split_point64(i + 1, n, g);
    }
  }
}

__device__ __forceinline__ long long rect_numel(const Rect& r, int ndim) {
  long long n = 1;
  for (int d = 0; d < ndim; ++d) n *= r.hi[d] - r.lo[d];
  return n;
}

// The k-th element (row-major) of rect ``r`` over the first ``ndim`` dims, as a multi-index.
__device__ __forceinline__ void rect_unravel(const Rect& r, int ndim, long long k, long long* idx) {
  for (int d = ndim - 1; d >= 0; --d) {
    const long long ext = r.hi[d] - r.lo[d];
    idx[d] = r.lo[d] + k % ext;
    k /= ext;
  }
}

__device__ __forceinline__ long long ravel(const long long* idx, const long long* shape, int ndim) {
  long long f = 0;
  for (int d = 0; d < ndim; ++d) f = f * shape[d] + idx[d];
  return f;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// max that propagates NaN, as torch.amax does (T = float or double)
template <typename T>
__device__ __forceinline__ T max_nan(T a, T b) {
  return (a != a || b != b) ? (a != a ? a : b) : fmax(a, b);
}

__device__ __forceinline__ float warp_max_nan(float v) {
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Copy an op's constants into shared memory with the whole CTA (16-byte words), then
// synchronise. The caller synchronises again before the copy is overwritten.
__device__ __forceinline__ void stage_op(OpC& dst, const OpC& src) {
  static_assert(sizeof(OpC) % 16 == 0, "OpC is copied in 16-byte words");
  const int4* s = reinterpret_cast<const int4*>(&src);
  int4* d = reinterpret_cast<int4*>(&dst);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(OpC) / 16); i += blockDim.x) d[i] = s[i];
  __syncthreads();
}

// d += a·b on the tensor cores: one m16n8k16 MMA, A row-major 16×16 and B column-major 16×8 of
// T (bf16 or f16) in the PTX fragment layout, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "MMA operands are bf16 or f16");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Four 8×8 matrices of 16-bit elements from shared memory, lane 8i + r giving the address of
// row r of matrix i (16 bytes); lane (g, t) = (lane / 4, lane % 4) receives elements (g, 2t) and
// (g, 2t + 1) of each, or with kTrans (2t, g) and (2t + 1, g).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
  }
}

// Two floats rounded to T (16-bit) in one 32-bit word, lo in the low half: an MMA operand pair.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T v[2] = {from_f<T>(lo), from_f<T>(hi)};
  uint32_t w;
  memcpy(&w, v, 4);
  return w;
}

// 16 bytes global → shared without a register round trip (sm_80+): a warp can have many in
// flight with no registers held for them.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem));
}

// 4 bytes global → shared (through L1: the 16-byte form alone may bypass it).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem));
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\n cp.async.wait_group 0;" ::: "memory");
}

// The thread's cp.async copies issued since the last commit form a group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most kPending of the thread's latest committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// cp_async16, or 16 zero bytes when !ok (nothing is read then; gmem must still be a valid address).
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem), "r"(ok ? 16 : 0));
}

constexpr int kThreadsPerTask = 256;  // mpk_runtime/persistent.cuh: kThreads

// Warp 0 is the gate warp: its thread 0 polls a gated task's event (wait_gate), and a poll
// queues behind the loads its own warp has in flight, not behind other warps' loads
// (benchmarks/micro/gate_poll.cu shows it). So a task that loads before its gate leaves warp 0
// none: the linear's other warps cp.async warp 0's first
// weights into ``words`` and count the copies on ``bar`` (each of the 224 threads of warps 1–7
// arrives when its copies have landed, warp 0's lane 0 arrives and waits). Thread 0 initialises
// ``bar`` once per launch (init_gate_share, before the launch's first barrier).
constexpr int kLinInFlight = 16;  // 16-byte weight loads each lane of a linear task keeps in flight (linalg.cuh)
constexpr int kGateShareWords = 32 * (kLinInFlight + 2);  // lin_unroll's rounding: 18 loads a lane at 6 blocks
struct GateShare {
  uint4 words[kGateShareWords];  // warp 0's weight loads in flight
  unsigned long long bar;
};
constexpr int kGateShareArrivals = kThreadsPerTask - 32 + 1;

__device__ __forceinline__ GateShare& gate_share() {
  __shared__ __align__(16) GateShare s;
  return s;
}

__device__ __forceinline__ unsigned gate_share_bar() {
  return static_cast<unsigned>(__cvta_generic_to_shared(&gate_share().bar));
}

__device__ __forceinline__ void init_gate_share() {
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(gate_share_bar()), "r"(kGateShareArrivals));
}

// Debug builds (MPK_DEBUG) trap after this many polls of any device wait loop.
#ifndef MPK_MAX_SPINS
#define MPK_MAX_SPINS (1LL << 26)
#endif

// What the tasks' own waits need of the launch, in shared memory, set at kernel entry (the tile
// kernel leaves the pointers null: nothing watches it): the host-mapped abort flag, this
// worker's host-mapped status row, the launch's epoch, the task the worker runs, and whether a
// wait inside that task was abandoned.
struct LaunchShared {
  volatile int* abort_flag;
  volatile int* status;
  int epoch;
  int task;
  int abandoned;  // set by task_wait_backoff on abort: the worker leaves after the task, owing no arrival
};

__device__ __forceinline__ LaunchShared& launch_shared() {
  __shared__ LaunchShared s;
  return s;
}

// The launch's epoch (the kernels set it at entry, before their first barrier).
__device__ __forceinline__ int& launch_epoch() { return launch_shared().epoch; }

// A wait inside a task body, as its status row names it.
enum TaskWait : int { kWaitMbarrier = 1, kWaitBusy = 2, kWaitSignal = 3 };
constexpr long long kTaskWaitCheck = 1024;  // polls between two back-offs of such a wait

// The back-off of a wait inside a task, every kTaskWaitCheck polls: tell the watchdog which
// task waits and on what, and return true when the watchdog stopped this launch (the caller
// stops waiting; the worker then leaves after the task). Out of line: only back-offs call it.
__device__ __noinline__ bool task_wait_backoff(int what, long long polls) {
  LaunchShared& l = launch_shared();
  if (l.status) {
    l.status[kStTask] = l.task;
    l.status[kStEvent] = what;
    l.status[kStSpins] = static_cast<int>(polls / kTaskWaitCheck);
    l.status[kStState] = kStateInTask;
  }
  if (l.abort_flag == nullptr || *l.abort_flag < l.epoch) return false;
  l.abandoned = 1;
  if (l.status) l.status[kStState] = kStateAborted;
  return true;
}

// Waits until the phase of the shared-memory mbarrier at ``bar`` that ``token`` (the state an
// arrival returned) belongs to has completed; false if the wait was abandoned (the launch was
// stopped: the caller finishes its task without the barrier's data, whose results nobody uses).
// The copies counted there always land, so only a bug could make this spin for ever: debug
// builds trap. Each try_wait suspends for a while, so the back-off needs no sleep.
__device__ __forceinline__ bool mbarrier_wait(unsigned bar, unsigned long long token) {
  for (long long polls = 1;; ++polls) {
    unsigned done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "l"(token) : "memory");
    if (done) return true;
    if (polls % kTaskWaitCheck == 0) {
      if (task_wait_backoff(kWaitMbarrier, polls)) return false;
#ifdef MPK_DEBUG
      if (polls > MPK_MAX_SPINS) __trap();
#endif
    }
  }
}

// Start copying an upcoming task's op constants into shared memory (when a task starts, for
// the next one, or while waiting for an event): the calling thread copies the 16-byte words
// first, first + step, …, so thread 0 alone passes (0, 1) and a warp's lanes (lane, 32). Each
// caller cp_async_wait_all()s before the constants are read.
__device__ __forceinline__ void prefetch_op(OpC& dst, const OpC& src, int first, int step) {
  const int4* s = reinterpret_cast<const int4*>(&src);
  int4* d = reinterpret_cast<int4*>(&dst);
  for (int i = first; i < static_cast<int>(sizeof(OpC) / 16); i += step) cp_async16(d + i, s + i);
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Shared-memory scratch of a task (one allocation, reused by every task family; a task must
// __syncthreads() before it returns if it used it). Sized for the largest user: the linear
// task's cross-warp reduction (8 warps × 64 columns × 16 rows) and attn_partial's warp states
// (8 warps × G·(D + 2) with G·D ≤ 1024).
constexpr int kScratchFloats = 8 * (1024 + 64);

__device__ __forceinline__ float* scratch() {
  __shared__ __align__(16) float s[kScratchFloats];  // 16-byte aligned: cp.async and vector accesses
  return s;
}

// The launch's dynamic shared memory, sized per graph by the host
// (mpk.executors.codegen.dynamic_smem_bytes, from the ops' GpuSpec.smem_bytes; none when no task
// uses it): the RMSNorm prologue's tile of normalised activations, and paged attention's second
// K/V slot per warp.
__device__ __forceinline__ uint4* norm_tile() {
  extern __shared__ __align__(16) uint4 mpk_dynamic_smem[];
  return mpk_dynamic_smem;
}

__device__ __forceinline__ unsigned dynamic_smem_size() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// Phase timer (builds with -DMPK_PHASES only; benchmarks/linear_phases.py): thread 0 of a CTA
// adds the nanoseconds since the previous mark to mpk_phase_ns[CTA][slot][phase], and counts
// the task in phase 7. It shows where a task's time goes inside it, which the per-task profiler
// cannot. The sums are reductions (no value returned): a read-modify-write would make thread 0
// wait a round trip inside the phase after each mark. Without MPK_PHASES the marks compile to
// nothing.
constexpr int kPhaseCtas = 256, kPhaseSlots = 40, kPhases = 8;
constexpr int kLinBlockCounts = 5;  // the linear's block counts (2, 3, 4, 6, 8: linalg.cuh, linear_variant1)
constexpr int kAttnPhaseSlot = 7 * kLinBlockCounts;  // linalg.cuh's 7 linear forms take the slots below (linear_phase_slot)
constexpr int kAttnWarmSlot = kAttnPhaseSlot + 1;    // attention run a second time in the same task (MPK_ATTN_WARM_RERUN)
#ifdef MPK_PHASES
extern "C" {
__device__ unsigned long long mpk_phase_ns[kPhaseCtas][kPhaseSlots][kPhases];
}
struct PhaseTimer {
  int slot;
  unsigned long long last;
  __device__ __forceinline__ explicit PhaseTimer(int s) : slot(s), last(globaltimer_ns()) {
    if (threadIdx.x == 0 && blockIdx.x < kPhaseCtas) atomicAdd(&mpk_phase_ns[blockIdx.x][slot][kPhases - 1], 1ULL);
  }
  __device__ __forceinline__ void mark(int phase) {
    const unsigned long long t = globaltimer_ns();
    if (threadIdx.x == 0 && blockIdx.x < kPhaseCtas) atomicAdd(&mpk_phase_ns[blockIdx.x][slot][phase], t - last);
    last = t;
  }
};
#else
struct PhaseTimer {
  __device__ __forceinline__ explicit PhaseTimer(int) {}
  __device__ __forceinline__ void mark(int) {}
};
#endif

// In a graph of AOT tasks only, the runtime starts a task while its dependent event is still
// pending, so the task can issue the loads that depend on nothing the graph computes (a linear
// task's weights) under that wait. Such a task opens the gate (acquire_inputs) before it reads
// anything else; every other task family has the gate opened for it by the dispatch before it
// runs. The gate's type and wait live in the runtime (mpk_runtime/persistent.cuh).
struct InputGate;
__device__ bool wait_gate(InputGate* gate);  // block-wide; false: the wait was abandoned (abort)

// A graph input holding a value its task cannot take (a token id outside the embedding table, a
// page table whose sequence does not count the token being decoded, or whose entries lie outside
// kv_indices, a page or the cache, a qo_indptr out of order or past the token rows): the task
// skips that work, so nothing is read or written out of bounds, and reports it. The first report
// of a launch lands in a host-mapped record that the executor raises as BadInputError after the
// launch (mpk.errors.BAD_INPUTS words each code); its epoch names the launch.
enum BadInputCode : int { kBadTokenId = 1, kBadPosition = 2, kBadPageSpan = 3, kBadLastPageLen = 4, kBadPage = 5,
                          kBadIndex = 6, kBadQoIndptr = 7, kBadQoLen = 8, kBadRowPosition = 9 };
struct BadInputRecord {
  int epoch, code, out_buffer, unused;
  long long row, value, limit;
};
}  // namespace mpk
extern "C" {  // global and unmangled: the executor finds them by name
__device__ mpk::BadInputRecord* mpk_bad_input;  // the host-mapped record, set once by the executor
__device__ int mpk_bad_input_claim;             // the latest epoch whose report was taken
}
namespace mpk {

__device__ __noinline__ void report_bad_input(int code, int out_buffer, long long row, long long value,
                                              long long limit) {
  const int epoch = launch_epoch();
  volatile BadInputRecord* rec = mpk_bad_input;
  if (rec == nullptr || atomicMax(&mpk_bad_input_claim, epoch) >= epoch) return;  // none, or taken
  rec->code = code;
  rec->out_buffer = out_buffer;
  rec->row = row;
  rec->value = value;
  rec->limit = limit;
  __threadfence_system();
  rec->epoch = epoch;  // last: the host reads a record whose epoch is new as complete
}

// Everything a task needs besides its op constants.
struct TaskEnv {
  void* const* buffers;
  InputGate* gate;  // null: the task's inputs are ready
};

// Block-wide: returns once the task's inputs are ready; false if the runtime abandoned the
// wait, and then the task must return at once (every thread gets the same answer).
__device__ __forceinline__ bool acquire_inputs(const TaskEnv& env) {
  return env.gate == nullptr || wait_gate(env.gate);
}

}  // namespace mpk

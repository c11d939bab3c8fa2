// The weight ring: a worker streams the weights of its AOT linear tasks, in the order it will
// run them, into a ring of shared-memory slots with TMA bulk copies, across task boundaries.
// A decode step is a chain of dependent stages; a task that loads its weights only when it
// starts leaves HBM idle at every stage boundary (the previous stage's tail, the hop, this
// one's ramp-up). Weights depend on nothing the graph computes, so the ring keeps each SM's
// copies in flight through gates, attention and norms: a linear task finds the first slots of
// its weights resident when its inputs become ready.
//
// The stream is host-built (mpk/megakernel/weight_ring.py): one 16-byte descriptor per slot, a
// block of up to 32 weight rows × 256 k, in exactly the order linear_ring consumes them. A slot
// is filled by up to four TMA tensor copies, boxes of 64 k × 8–32 rows (tensor maps per weight
// and box height, encoded by the host), stored with the 128-byte swizzle: box b of the slot at
// b·4 KiB, row r at r·128 bytes, its 16-byte chunk c at c ^ (r & 7). Slot i of the stream lives
// in ring slot i mod S. Per slot two mbarriers: ``full`` (the fill's bytes landed: TMA
// transaction count) and ``empty`` (all 8 warps read it). Warp 0 of the CTA is the producer,
// inside the consuming task: after each of its groups it refills the slots the group before
// released, so the ring is topped up to S slots ahead of the consumer whenever the CTA is not
// consuming (gates, other task families). Descriptors arrive in blocks of 16 by bulk copy into
// two halves (one in use, one landing).
#pragma once
#include "common.cuh"

namespace mpk {

constexpr int kRingRows = 32;    // weight rows a slot holds: two m16 MMA blocks
constexpr int kRingK = 256;      // k elements of a row a slot holds
constexpr int kRingBoxK = 64;    // k elements per tensor copy: one 128-byte swizzled row
constexpr int kRingBoxBytes = kRingRows * kRingBoxK * 2;
constexpr int kRingSlotBytes = kRingRows * kRingK * 2;
constexpr int kRingAlign = 1024;    // the 128-byte swizzle's atom: slots start at multiples of it
constexpr int kRingDescBlock = 16;  // descriptors per bulk copy; the host repeats a stream's first block after it
constexpr int kTensorMapBytes = 128;

// One slot's fill (mpk/megakernel/weight_ring.py: DESC_DTYPE).
struct alignas(16) RingDesc {
  unsigned map;     // tensor map index
  int x, y;         // the box's first k and first row
  unsigned char boxes, box_rows, pad[2];  // 64-k copies (≤ 4) and rows per copy (8, 16, 24 or 32)
};
static_assert(sizeof(RingDesc) == 16, "RingDesc is one bulk-copy word");

// A worker's ring, in shared memory (the slots, descriptors and barriers in the launch's
// dynamic shared memory after the norm tile).
struct WeightRing {
  unsigned char* slots;       // nslots × kRingSlotBytes
  RingDesc* desc;             // 2 × kRingDescBlock
  unsigned long long* full;   // per slot
  unsigned long long* empty;  // per slot
  unsigned long long* dfull;  // per descriptor half
  const RingDesc* table;      // this worker's stream (count entries, then its first block again)
  const unsigned char* maps;  // the tensor maps (global memory, kTensorMapBytes each)
  volatile int* abort_flag;
  unsigned count, total, nslots;  // total: count × iterations, the slots the launch consumes
  unsigned issued, consumed;      // written by warp 0's lane 0 / thread 0 only
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}

__device__ __forceinline__ bool mbar_done(unsigned long long* b, unsigned parity) {
  unsigned ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok) : "r"(smem_u32(b)), "r"(parity) : "memory");
  return ok != 0;
}

// global → shared, completing ``bytes`` transactions on ``bar`` (sm_90 TMA; 16-byte multiples)
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// The box of a 2-d tensor map at (x, y) → shared, completing its bytes on ``bar``
__device__ __forceinline__ void tensor_copy_g2s(void* dst, const void* map, int x, int y, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(x), "r"(y), "r"(smem_u32(bar)) : "memory");
}

// Waits for phase ``parity`` of ``b``. Fills always land, so only a stream that disagrees with
// its consumers (a bug) can hang here: debug builds trap after MPK_MAX_SPINS polls, and an
// abort from the watchdog traps too (a task cannot leave mid-stream).
__device__ __forceinline__ void ring_wait(const WeightRing& R, unsigned long long* b, unsigned parity) {
  long long polls = 0;
  while (!mbar_done(b, parity)) {
    if ((++polls & 4095) == 0) {
      if (*R.abort_flag) __trap();
#ifdef MPK_DEBUG
      if (polls > MPK_MAX_SPINS) __trap();
#endif
    }
  }
}

// Lane 0 of warp 0: bulk-copy descriptor block q into half q & 1.
__device__ __forceinline__ void ring_fetch_desc(const WeightRing& R, unsigned q) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the half's previous reads came first
  const unsigned h = q & 1u;
  constexpr unsigned kBytes = kRingDescBlock * sizeof(RingDesc);
  mbar_expect_tx(R.dfull + h, kBytes);
  bulk_copy_g2s(R.desc + h * kRingDescBlock, R.table + (q * kRingDescBlock) % R.count, kBytes, R.dfull + h);
}

// Warp 0: issue the stream's slots below ``target`` (and below total), each once the 8 warps
// released the slot's previous use. Lane b issues the slot's box b.
__device__ __noinline__ void ring_refill(WeightRing& R, unsigned target) {
  const int lane = threadIdx.x & 31;
  const unsigned end = min(target, R.total);
  unsigned i = R.issued;
  for (; i < end; ++i) {
    const unsigned s = i % R.nslots, q = i / kRingDescBlock;
    if (i >= R.nslots) ring_wait(R, R.empty + s, (i / R.nslots - 1) & 1u);
    if (lane == 0 && i % kRingDescBlock == 0 && (q + 1) * kRingDescBlock < R.total) ring_fetch_desc(R, q + 1);
    ring_wait(R, R.dfull + (q & 1u), (q >> 1) & 1u);
    const RingDesc d = R.desc[(q & 1u) * kRingDescBlock + i % kRingDescBlock];
    if (lane == 0) mbar_expect_tx(R.full + s, static_cast<unsigned>(d.boxes) * d.box_rows * (kRingBoxK * 2));
    __syncwarp();
    if (lane < d.boxes) {
      tensor_copy_g2s(R.slots + s * kRingSlotBytes + lane * kRingBoxBytes, R.maps + d.map * kTensorMapBytes,
                      d.x + lane * kRingBoxK, d.y, R.full + s);
    }
  }
  __syncwarp();
  if (lane == 0) R.issued = i;
  __syncwarp();
}

// Thread 0 at the worker's start: lay the ring out in ``smem`` (kRingAlign bytes beyond the ring
// are spare: its start is rounded up to that alignment) and initialise its barriers. The CTA
// synchronises, then warp 0 calls ring_start.
__device__ __noinline__ void ring_init(WeightRing& R, unsigned char* smem, int nslots, const RingDesc* table,
                                       int entries, int iterations, const void* maps, volatile int* abort_flag) {
  smem += (kRingAlign - smem_u32(smem) % kRingAlign) % kRingAlign;
  R.slots = smem;
  R.desc = reinterpret_cast<RingDesc*>(smem + nslots * kRingSlotBytes);
  R.full = reinterpret_cast<unsigned long long*>(R.desc + 2 * kRingDescBlock);
  R.empty = R.full + nslots;
  R.dfull = R.empty + nslots;
  R.table = table;
  R.maps = static_cast<const unsigned char*>(maps);
  R.abort_flag = abort_flag;
  R.count = entries > kRingDescBlock ? static_cast<unsigned>(entries - kRingDescBlock) : 0u;
  R.total = R.count * static_cast<unsigned>(iterations);
  R.nslots = static_cast<unsigned>(nslots);
  R.issued = R.consumed = 0;
  for (int s = 0; s < nslots; ++s) {
    mbar_init(R.full + s, 1);
    mbar_init(R.empty + s, kThreadsPerTask / 32);
  }
  mbar_init(R.dfull, 1);
  mbar_init(R.dfull + 1, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Warp 0: the first descriptor block, then the first S slots.
__device__ __noinline__ void ring_start(WeightRing& R) {
  if (R.total == 0) return;
  if ((threadIdx.x & 31) == 0) ring_fetch_desc(R, 0);
  __syncwarp();
  ring_refill(R, R.nslots);
}

// Warp 0 when the worker leaves: fills still in flight (a launch abandoned mid-stream) land
// before the CTA's shared memory goes away.
__device__ __noinline__ void ring_drain(const WeightRing& R) {
  for (unsigned c = R.consumed; c < R.issued; ++c) {
#ifdef MPK_DEBUG
    long long polls = 0;
#endif
    while (!mbar_done(R.full + c % R.nslots, (c / R.nslots) & 1u)) {  // no abort check: an abort needs this wait
#ifdef MPK_DEBUG
      if (++polls > MPK_MAX_SPINS) __trap();
#endif
    }
  }
}

// Consumers (every thread of the CTA): stream slot c, once landed.
__device__ __forceinline__ const uint4* ring_acquire(const WeightRing& R, unsigned c) {
  const unsigned s = c % R.nslots;
  ring_wait(R, R.full + s, (c / R.nslots) & 1u);
  return reinterpret_cast<const uint4*>(R.slots + s * kRingSlotBytes);
}

// A warp done reading stream slot c.
__device__ __forceinline__ void ring_release(const WeightRing& R, unsigned c) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(R.empty + c % R.nslots);
}

}  // namespace mpk

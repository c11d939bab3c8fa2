// The page table as the paged tasks read it (mpk/ops/paged.py documents it): a sequence's span
// of kv_indices and its length, its pages, and the checks a task applies before following
// them (each fault skipped and reported: BadInputCode in common.cuh); the ragged form's rows
// (qo_indptr) likewise.
#pragma once
#include "common.cuh"

namespace mpk {

// Where sequence b's pages start in kv_indices, and its length.
struct SeqSpan {
  long long first_page, len;
};

// The tests a task applies to a page table before following it; host code too (a CPU test
// checks them against mpk.ops.paged.checked_lens). span_fault: what is wrong with sequence b's
// span (p0, p1: its kv_indptr entries; tail: its kv_last_page_len; n: kv_indices' length) — a
// kv_indptr entry outside kv_indices or below the one before it (kBadPageSpan, naming the
// entry), a last page holding not 1…page_size positions (kBadLastPageLen) — with the row, value
// and limit its report names; code 0: nothing. page_ok: the cache has the page.
struct SpanFault {
  int code;
  long long row, value, limit;
};
__host__ __device__ __forceinline__ SpanFault span_fault(long long b, long long p0, long long p1, long long tail,
                                                         long long n, int page_size) {
  if (p0 < 0 || p0 > n) return {kBadPageSpan, b, p0, n};
  if (p1 < p0 || p1 > n) return {kBadPageSpan, b + 1, p1, n};
  if (p1 > p0 && (tail < 1 || tail > page_size)) return {kBadLastPageLen, b, tail, page_size};
  return {0, 0, 0, 0};
}
__host__ __device__ __forceinline__ bool page_ok(long long page, long long num_pages) {
  return static_cast<unsigned long long>(page) < static_cast<unsigned long long>(num_pages);
}

// The reports, out of line: the tasks' code holds only the tests and one call each (a task
// whose code grows pays for fetching it in every layer).
__device__ __noinline__ void report_span_fault(long long b, long long p0, long long p1, long long tail, long long n,
                                               int page_size, int out_buffer) {
  const SpanFault f = span_fault(b, p0, p1, tail, n, page_size);
  report_bad_input(f.code, out_buffer, f.row, f.value, f.limit);
}

// Sequence b's span. I: the page table's integer type (int or long long; codegen checks that
// its three tensors share it). A span with a fault is reported and taken as empty, so
// that every entry of kv_indices a task looks up (for a position below len) is the sequence's.
template <typename I>
__device__ __forceinline__ SeqSpan seq_span(const TaskEnv& env, const ViewC& indptr, const ViewC& indices,
                                            const ViewC& last, long long b, int page_size, int out_buffer) {
  // three independent loads: one round trip
  const I* ip = static_cast<const I*>(env.buffers[indptr.buffer]) + indptr.offset;
  const long long p0 = ip[b * indptr.stride[0]], p1 = ip[(b + 1) * indptr.stride[0]];
  const long long tail = static_cast<const I*>(env.buffers[last.buffer])[last.offset + b * last.stride[0]];
  if (span_fault(b, p0, p1, tail, indices.shape[0], page_size).code != 0) {
    report_span_fault(b, p0, p1, tail, indices.shape[0], page_size, out_buffer);
    return SeqSpan{0, 0};
  }
  return SeqSpan{p0, p1 == p0 ? 0 : (p1 - p0 - 1) * page_size + tail};
}

// A sequence's page table, its pages from kv_indices[first_page] on: pages(t) is the page of
// position t. Built once per sequence, so that a loop holds the row's address in registers (the
// cp.async asm's memory clobbers would otherwise make it reload the buffer table, then the
// address, every step: a chain of dependent loads before each lookup).
template <typename I>
struct SeqPages {
  const I* row;
  long long stride;
  int shift;
  __device__ __forceinline__ SeqPages(const TaskEnv& env, const ViewC& indices, long long first_page, int shift_)
      : row(static_cast<const I*>(env.buffers[indices.buffer]) + indices.offset + first_page * indices.stride[0]),
        stride(indices.stride[0]),
        shift(shift_) {}
  __device__ __forceinline__ I operator()(long long t) const { return row[(t >> shift) * stride]; }
};

template <typename I>
__device__ __forceinline__ long long page_of(const TaskEnv& env, const ViewC& indices, long long first_page,
                                             long long t, int shift) {
  return SeqPages<I>(env, indices, first_page, shift)(t);
}

// seq_span out of line, for a tile's sequences after its first (batch ≥ 2): a call each,
// against code that every attention task fetches.
template <typename I>
__device__ __noinline__ SeqSpan next_span(const TaskEnv& env, const ViewC& indptr, const ViewC& indices,
                                          const ViewC& last, long long b, int page_size, int out_buffer) {
  return seq_span<I>(env, indptr, indices, last, b, page_size, out_buffer);
}

// Reports the first entry of a sequence's pages (kv_indices[first_page …], len positions) that
// the cache does not have, naming its index in kv_indices. A task that met one (page_ok false)
// reads page 0 in its place or skips the append, and calls this after its loop (each lane that
// met one; the launch keeps the first report).
template <typename I>
__device__ __noinline__ void report_bad_page(SeqPages<I> pages, long long first_page, long long len,
                                             long long num_pages, int out_buffer) {
  for (long long t = 0; t < len; t += 1LL << pages.shift) {
    const long long page = pages(t);
    if (!page_ok(page, num_pages)) {
      report_bad_input(kBadPage, out_buffer, first_page + (t >> pages.shift), page, num_pages);
      return;
    }
  }
}

__device__ __forceinline__ int log2_pow2(int x) { return 31 - __clz(x); }

// --- the ragged form: qo_indptr [B + 1] (mpk.ops.paged: qo_rows) ------------------------------

// Whether qo_indptr's entry i (value v; prev: entry i − 1, unused for i = 0) is at fault for T
// token rows (kBadQoIndptr): past the rows, entry 0 not 0, or below the entry before it. Host
// code too (a CPU test checks it against mpk.ops.paged.qo_rows).
__host__ __device__ __forceinline__ bool qo_entry_fault(long long i, long long v, long long prev, long long T) {
  return v > T || (i == 0 ? v != 0 : v < prev);
}

// The sequence b of token row t < qo_indptr[B] (B = entries − 1): qo_indptr[b] ≤ t < qo_indptr[b + 1],
// by binary search over a qo_indptr without fault (a sequence with no rows is never found).
template <typename I>
__host__ __device__ __forceinline__ long long qo_sequence(const I* qo, long long stride, long long B, long long t) {
  long long lo = 0, hi = B;  // qo[lo] ≤ t < qo[hi]
  while (hi - lo > 1) {
    const long long mid = (lo + hi) >> 1;
    if (qo[mid * stride] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// Whether qo_indptr (view qo, for T token rows) is without fault, checked by the calling warp
// (every lane gets the answer; a coalesced pass over the entries); the first entry at fault is
// reported. A task checks all of it before it looks a row up: qo_sequence needs the order.
template <typename I>
__device__ __noinline__ bool qo_ok(const TaskEnv& env, const ViewC& qo, long long T, int out_buffer) {
  const I* p = static_cast<const I*>(env.buffers[qo.buffer]) + qo.offset;
  const int lane = threadIdx.x & 31;
  for (long long base = 0; base < qo.shape[0]; base += 32) {
    const long long i = base + lane;
    const long long v = i < qo.shape[0] ? static_cast<long long>(p[i * qo.stride[0]]) : 0;
    const long long prev = i > 0 && i < qo.shape[0] ? static_cast<long long>(p[(i - 1) * qo.stride[0]]) : 0;
    const unsigned bad = __ballot_sync(0xffffffffu, i < qo.shape[0] && qo_entry_fault(i, v, prev, T));
    if (bad) {
      if (lane == __ffs(bad) - 1) report_bad_input(kBadQoIndptr, out_buffer, i, v, T);
      return false;
    }
  }
  return true;
}

// A token row of the ragged form: its sequence's span, its position (p_t = n_b − qo_indptr[b+1]
// + t) and where its sequence's rows end (qo_indptr[b + 1]); pos −1: a padding row, or one whose
// sequence the task cannot follow (a fault of its span, reported by seq_span, or more new rows
// than its length: reported here). qo_indptr must have passed qo_ok.
struct RaggedRow {
  SeqSpan span;
  long long pos, rows_end;
};
template <typename I>
__device__ __noinline__ RaggedRow ragged_row(const TaskEnv& env, const ViewC& indptr, const ViewC& indices,
                                             const ViewC& last, const ViewC& qo, long long t, int page_size,
                                             int out_buffer) {
  const I* q = static_cast<const I*>(env.buffers[qo.buffer]) + qo.offset;
  const long long B = qo.shape[0] - 1, st = qo.stride[0];
  if (t >= q[B * st]) return RaggedRow{SeqSpan{0, 0}, -1, 0};
  const long long b = qo_sequence(q, st, B, t), r0 = q[b * st], r1 = q[(b + 1) * st];
  const SeqSpan s = seq_span<I>(env, indptr, indices, last, b, page_size, out_buffer);
  if (r1 - r0 > s.len) {
    report_bad_input(kBadQoLen, out_buffer, b, r1 - r0, s.len);
    return RaggedRow{s, -1, r1};
  }
  return RaggedRow{s, s.len - r1 + t, r1};
}

}  // namespace mpk

// The persistent kernel: one cooperative launch, one CTA per SM. CTAs [0, num_workers) are
// workers; the rest host scheduler warps (kSchedWarpsPerCta each). Include this after the
// generated code has defined ``mpk_execute_task(op, tile, slot, staged, gate)``,
// ``mpk_prefetch_op(op, slot, first, step)`` and ``mpk_stage_buffers()`` (over its own op and
// buffer tables).
//
// Worker (thread 0 decides, the CTA executes): its JIT ring first; else the head of its AOT list
// once that task's dependent event reached iteration·num_triggers; else spin. Op constants live
// in two shared-memory slots (OpSlots): when a task starts, the last warp starts copying the next AOT
// head's constants into the other slot (mpk_prefetch_op), and they land while the task runs. In a graph
// without JIT tasks the worker does not spin there: it starts the head at once with an
// InputGate, and the task waits for the event inside (after the loads that need nothing the
// graph computes: a linear task's weights). With JIT tasks it could then wait on a task that
// a scheduler hands this very worker, so there the worker waits outside, serving its ring. After a
// task the CTA synchronises and thread 0 adds its arrival to the task's trigger event with
// release order (coalesced over consecutive tasks with the same trigger; see arrive for when
// that is a store or a fire-and-forget reduction); the add that completes a multiple of
// num_triggers fires the event. Firing an event that launches JIT tasks writes the iteration
// number into each active scheduler's mailbox slot for it; the end event starts the next
// iteration (start counter += 1) or, after the last, sets ``done``. An event whose only task is a
// JIT task (kEventLocalJit, set by the host) goes to no scheduler: the worker that fired it runs
// the task next — it is free, and the task's inputs are ready — saving the two hops through a
// scheduler and its ring.
//
// The host passes the tables' placement (mpk/compiler/place.py): worker w's AOT list is the
// tables' worker_tasks[worker_offsets[w], worker_offsets[w+1]), the CTA counts are the tables'.
// Scheduler warp s owns workers w ≡ s (mod active schedulers) and is the only producer of their
// JIT rings. Its 32 lanes poll 32 consecutive mailbox slots (events in linear order, so an
// event's prerequisites never lie beyond the window); for a fired event it takes every
// active-scheduler-th of the event's tasks and hands them, round-robin, to its own workers.
#pragma once
#include "sync.cuh"
#include "types.cuh"

namespace mpk {

constexpr int kThreads = 256;
static_assert(kThreads == kThreadsPerTask, "the tasks (mpk_tasks/common.cuh: kThreadsPerTask) size their work and gate_share for this block");
constexpr int kSchedWarpsPerCta = 4;
constexpr int kExit = -2;

constexpr int kMaxWorkersPerScheduler = 136;

// A copy of the arguments in shared memory, for code that reaches them through a pointer: the
// out-of-line functions and the gate. Inlined code reads the parameter bank directly; through a
// pointer that bank is reached by generic loads that miss L1 (each hop's acquire invalidated
// it), which the gate's wake-up would wait for.
__device__ __forceinline__ RuntimeArgs& shared_args() {
  __shared__ RuntimeArgs s_args;
  return s_args;
}

// Tell every active scheduler that JIT event e fired in iteration k (one fence, then stores;
// ``fenced``: the caller's fence already released this CTA's writes).
__device__ __forceinline__ void notify_event(const RuntimeArgs& a, const EventRef& e, unsigned long long k,
                                             bool fenced = false) {
  if (e.jit_index < 0) return;
  if (!fenced) cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device);
  for (int s = 0; s < a.active_schedulers; ++s) {
    dev_atomic_u64(a.mailbox[static_cast<long long>(s) * a.num_jit_events + e.jit_index])
        .store(k, cuda::memory_order_relaxed);
  }
}

// A JIT task of a kEventLocalJit event that this worker fired, and the iteration it belongs to.
struct LocalTask {
  int task = -1, iter = 0;
};

// The arrival at an event that launches JIT tasks, or at the end event: out of line, so the
// worker loop's inlined code stays small (register pressure there slows graphs without JIT
// tasks; the call costs a JIT hop a little).
__device__ __noinline__ LocalTask arrive_jit(const RuntimeArgs& a, const EventRef e, unsigned count, int iter) {
  const bool one = e.num_triggers == 1 && iter > 0;
  const bool local = e.flags & kEventLocalJit;
  if (one && e.id != a.end_event) {
    const unsigned long long k = static_cast<unsigned long long>(iter);
    if (local) {  // nobody waits on the counter; it is kept for the watchdog's report
      dev_atomic_u64(a.counters[e.id]).store(k, cuda::memory_order_relaxed);
      return {e.first_task, iter};
    }
    cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device);
    dev_atomic_u64(a.counters[e.id]).store(k, cuda::memory_order_relaxed);
    notify_event(a, e, k, true);
    return {};
  }
  const unsigned long long n = static_cast<unsigned long long>(e.num_triggers);
  const unsigned long long now = add_release(a.counters + e.id, count) + count;
  if (now % n != 0) return {};
  if (e.id != a.end_event) {
    if (local) return {e.first_task, static_cast<int>(now / n)};
    notify_event(a, e, now / n);
    return {};
  }
  if (now / n < static_cast<unsigned long long>(a.iterations)) {
    const unsigned long long next = add_release(a.counters + a.start_event, 1) + 1;
    const EventDesc& sd = a.events[a.start_event];
    notify_event(a, EventRef{a.start_event, sd.num_triggers, sd.first_task, sd.last_task, sd.flags, a.start_jit_index},
                 next);
  } else {
    dev_atomic_u32(*a.done).store(1u, cuda::memory_order_release);
  }
  return {};
}

// ``count`` arrivals at event e (release); the add that reaches a multiple of num_triggers fires
// it. Nobody waits for an atomic's reply unless the arrival must learn whether it fired the
// event: an event that launches no JIT task (its waiters poll the counter) gets a
// fire-and-forget reduction, or a store of the counter's next value when it has a single
// trigger whose task knows its iteration (AOT tasks, and JIT tasks, which their scheduler
// stamps); such a single-trigger event that launches JIT tasks is stored and its schedulers told
// behind one release fence. Returns the task the caller runs itself when it fired a
// kEventLocalJit event (its single trigger ran on this CTA, or the acq_rel add acquired the
// other triggers' writes).
__device__ __forceinline__ LocalTask arrive(const RuntimeArgs& a, const EventRef& e, unsigned count, int iter) {
  if (e.jit_index < 0 && e.id != a.end_event) {
    hop_mark(kHopRelease);
    if (e.num_triggers == 1 && iter > 0) {
      store_release(a.counters + e.id, static_cast<unsigned long long>(iter));
    } else {
      red_release(a.counters + e.id, count);
    }
    return {};
  }
  return arrive_jit(shared_args(), e, count, iter);
}

// A JIT task its arrival fired for the worker to run (kEventLocalJit) waits in the worker's
// shared-memory slot (not in registers: graphs without JIT tasks pay nothing for it).
// next_task takes it before anything else, and every flush finds the slot empty (a flush
// follows a task in the worker loop or ends next_task's search, and either way next_task
// returns the slot's task first, or it follows next_task returning a task with the same
// trigger, which leaves nothing to flush).
__device__ __forceinline__ LocalTask& local_slot() {
  __shared__ LocalTask s_local;
  return s_local;
}

// Arrivals a worker owes one event, added in one atomic: consecutive tasks of a worker that
// trigger the same event (a fan-in) cost one atomic, not one each. Flushed before the worker
// runs a task that triggers another event and before it waits, so no event is held back
// while anyone waits for it.
struct Pending {
  EventRef event{-1};
  unsigned count = 0;
  int iter = 0;

  __device__ __forceinline__ void add(const RuntimeArgs& a, const TaskInfo& t) {
    if (t.trig.id != event.id) flush(a);
    event = t.trig;
    iter = t.iter;
    ++count;
  }
  __device__ __forceinline__ void flush(const RuntimeArgs& a) {
    if (count) {
      const LocalTask l = arrive(a, event, count, iter);
      if (l.task >= 0) {
#ifdef MPK_DEBUG
        if (local_slot().task >= 0) __trap();
#endif
        local_slot() = l;
      }
    }
    count = 0;
  }
};

// The entry after a worker's AOT head, in shared memory: the worker's last warp copies it there
// while a task runs (worker_loop). Loaded into thread 0's registers instead, it stalled thread 0
// for the load's whole round trip on every task's way out — moving the value into a register
// that survives the call into the task waits for the load.
__device__ __forceinline__ AotEntry& aot_next_slot() {
  __shared__ AotEntry s_next;
  return s_next;
}

// A worker's AOT list: the head in registers; the entry after it comes through aot_next_slot,
// asked for at each consume and copied during the next task (`ask` names its source), read at
// the consume after that task. Two consumes with no task between (dummy tasks, which thread 0
// completes in passing) load the entry themselves.
struct AotCursor {
  int begin, count, idx = 0, iter = 1, iterations;  // head = entry idx of iteration iter (1-based)
  AotEntry head;
  const AotEntry* ask = nullptr;  // the entry after head, for the next task's last warp to copy (null: none)
  bool staged = false;            // aot_next_slot holds the entry after head
  int seen_event = -1;  // counters only grow: once seen_event reached seen_need, it stays there
  unsigned long long seen_need = 0;

  __device__ __forceinline__ bool left() const { return count > 0 && iter <= iterations; }
  __device__ __forceinline__ long long pos() const { return static_cast<long long>(iter - 1) * count + idx; }
  // the entry after head: idx + 1 in this iteration, or the first of the next (null past the end)
  __device__ __forceinline__ const AotEntry* after_head(const RuntimeArgs& a) const {
    const int i = idx + 1 < count ? idx + 1 : 0, it = idx + 1 < count ? iter : iter + 1;
    return it <= iterations ? a.aot_entries + begin + i : nullptr;
  }
  __device__ __forceinline__ void start(const RuntimeArgs& a) {
    if (count == 0) return;
    head = a.aot_entries[begin];
    ask = after_head(a);
  }
  __device__ __forceinline__ unsigned long long need() const {
    return static_cast<unsigned long long>(iter) * static_cast<unsigned long long>(head.dep_triggers);
  }
  __device__ __forceinline__ TaskInfo consume(const RuntimeArgs& a) {
    TaskInfo ready = head.info;
    ready.iter = iter;
    const AotEntry* following = ask;
    if (++idx == count) {
      idx = 0;
      ++iter;
    }
    head = !following ? AotEntry{} : staged ? aot_next_slot() : *following;
    ask = after_head(a);
    staged = false;
    return ready;
  }
  // a task ran since the last consume, and its last warp copied `ask` into aot_next_slot
  __device__ __forceinline__ void landed() { staged = ask != nullptr; }
};

// What a worker waiting for an AOT task's event tells the watchdog (host-mapped status words):
// ``state`` is kStateWaitingAot before it takes the task, kStateGate at a started task's gate.
__device__ __forceinline__ void publish_aot_wait(volatile int* status, int state, int task, int event,
                                                 unsigned long long have, unsigned long long need, long long aot_pos,
                                                 unsigned long long jit_head) {
  status[kStState] = state;
  status[kStTask] = task;
  status[kStEvent] = event;
  status[kStCountLo] = static_cast<int>(have);
  status[kStNeedLo] = static_cast<int>(need);
  status[kStAotPos] = static_cast<int>(aot_pos);
  status[kStJitHead] = static_cast<int>(jit_head);
}

// A task started before its dependent event fired (see the top): what it waits for, and what
// the watchdog is told meanwhile. In shared memory: thread 0 waits, the CTA reads ``open``.
struct InputGate {
  unsigned long long* counter;
  unsigned long long need;
  const RuntimeArgs* args;  // shared_args()
  volatile int* status;
  int event, task, aot_pos;
  int profile;  // stamp opened_ns (a copy: the wake-up path reads nothing through args)
  int open;     // -1 until the task opened it, then 1, or 0 when the wait was abandoned (abort)
  unsigned long long reached_ns, opened_ns;  // profile: when the task reached the gate (MPK_HOP_STAMPS), when it opened
  unsigned long long seen;  // the counter's value that opened it
};

// Declared in mpk_tasks/common.cuh; the task calls it through acquire_inputs.
__device__ __forceinline__ bool wait_gate(InputGate* g) {
  if (threadIdx.x == 0) {
#ifdef MPK_HOP_STAMPS
    if (g->profile) g->reached_ns = globaltimer_ns();
#endif
    Spin spin;
    unsigned long long have;
    int open = 1;
    // in registers: the acquire is a compiler barrier, so fields read in the loop are re-read
    // from shared memory before every poll
    unsigned long long* const counter = g->counter;
    const unsigned long long need = g->need;
    while ((have = load_acquire(counter)) < need) {
      if ((spin.polls & 1023) == 1023) publish_aot_wait(g->status, kStateGate, g->task, g->event, have, need, g->aot_pos, 0);
      if (spin.pause(*g->args, g->status)) {
        g->status[kStState] = kStateAborted;
        open = 0;
        break;
      }
    }
    hop_mark(kHopSeen);
    g->open = open;
    g->seen = have;
    if (g->profile) g->opened_ns = globaltimer_ns();
  }
  __syncthreads();
  hop_mark(kHopStart);
  return g->open == 1;
}

// Thread 0's record of the two shared-memory slots of op constants: which op each holds or is
// receiving, and which the latest task used (the other one takes the next prefetch).
// Two named fields, not an array: a dynamically indexed array would live in local memory.
struct OpSlots {
  int op0 = -1, op1 = -1;
  int last = 0;

  __device__ __forceinline__ int find(int o) const { return op0 == o ? 0 : op1 == o ? 1 : -1; }
  __device__ __forceinline__ void set(int slot, int o) { (slot == 0 ? op0 : op1) = o; }
  __device__ __forceinline__ void prefetch(int o) {  // o's constants into the slot not in use
    if (o < 0 || find(o) >= 0) return;
    mpk_prefetch_op(o, 1 - last, 0, 1);
    set(1 - last, o);
  }
  // the slot o's constants should go to (the caller's warp copies them), or -1: already there
  __device__ __forceinline__ int claim(int o) {
    if (o < 0 || find(o) >= 0) return -1;
    set(1 - last, o);
    return 1 - last;
  }
};

// The task in the local slot, which the worker runs next (out of line: JIT graphs only; it
// takes the shared copy of the arguments, and no reference to the caller's registers).
__device__ __noinline__ TaskInfo load_local(const RuntimeArgs& a) {
  const LocalTask l = local_slot();
  local_slot() = LocalTask{};
  TaskInfo t = a.task_infos[l.task];
  t.iter = l.iter;
  return t;
}

__device__ __forceinline__ TaskInfo take_local(const RuntimeArgs& a, Pending& pending) {
  const TaskInfo t = load_local(shared_args());
  if (t.trig.id != pending.event.id) pending.flush(a);
  return t;
}

// Thread 0 of a worker: the next task (JIT queue first, then the AOT head once its event fired,
// or at once in a graph without JIT tasks: then ``gate`` says what it must wait for).
__device__ TaskInfo next_task(const RuntimeArgs& a, int w, AotCursor& aot, unsigned long long& jit_head,
                              Pending& pending, OpSlots& slots, InputGate& gate) {
  Ring<TaskInfo> jit = Ring<TaskInfo>::at(a.jit_values, a.jit_seq, a.jit_head, a.jit_capacity, w);
  volatile int* status = a.status + static_cast<long long>(w) * kStatusWords;
  // a JIT task this worker's own arrival released comes first (checked before every flush)
  TaskInfo t;
  if (a.any_jit && local_slot().task >= 0) return take_local(a, pending);
  if (!(aot.left() && aot.head.info.trig.id == pending.event.id)) pending.flush(a);
  Spin spin;
  while (true) {
    if (a.any_jit && local_slot().task >= 0) return take_local(a, pending);
    const bool aot_left = aot.left();
    const unsigned long long need = aot_left ? aot.need() : 0;
    const bool known = aot_left && aot.head.dep == aot.seen_event && need <= aot.seen_need;
    // The JIT ring is peeked (relaxed) before the counter's acquire load, so both are in
    // flight together; graphs without JIT tasks skip the peek.
    const unsigned long long peeked = a.any_jit ? jit.peek(jit_head) : 0;
    // Without JIT tasks the head starts gated anyway (below), and its gate polls after the
    // task's first weight loads went out: polling here too would put a round trip between a
    // task's end and its successor's loads.
    const bool poll = aot_left && !known && (a.any_jit || aot.head.info.op < 0);
    const unsigned long long have = poll ? load_acquire(a.counters + aot.head.dep) : 0;
    if (a.any_jit && jit.try_pop(jit_head, t, peeked)) {
      if (t.trig.id != pending.event.id) pending.flush(a);
      return t;
    }
    if (aot_left) {
      if (known) return aot.consume(a);
      if (have >= need) {
        aot.seen_event = aot.head.dep;
        aot.seen_need = have;
        return aot.consume(a);
      }
      pending.flush(a);  // about to wait: owe nothing to anyone
      slots.prefetch(aot.head.info.op);  // and fetch the task's constants meanwhile (if not there yet)
      if (!a.any_jit && aot.head.info.op >= 0) {  // start it now; it waits inside (wait_gate)
        gate = InputGate{a.counters + aot.head.dep, need, &shared_args(), status, aot.head.dep, aot.head.info.task,
                         static_cast<int>(aot.pos()), a.profile != nullptr, -1, 0};
        return aot.consume(a);
      }
      if ((spin.polls & 1023) == 1023) {
        publish_aot_wait(status, kStateWaitingAot, aot.head.info.task, aot.head.dep, have, aot.need(), aot.pos(),
                         jit_head);
      }
    } else {
      pending.flush(a);
      if (dev_atomic_u32(*a.done).load(cuda::memory_order_acquire)) return TaskInfo{kExit, -1};
      if ((spin.polls & 1023) == 1023) {
        status[kStState] = kStateIdle;
        status[kStAotPos] = static_cast<int>(aot.pos());
        status[kStJitHead] = static_cast<int>(jit_head);
      }
    }
    if (spin.pause(a, status)) {
      status[kStState] = kStateAborted;
      return TaskInfo{kExit, -1};
    }
  }
}

__device__ void worker_loop(const RuntimeArgs& a, int w) {
  __shared__ TaskInfo s_task;
  __shared__ int s_slot;     // the op-constant slot of s_task
  __shared__ bool s_staged;  // that slot already holds s_task's op constants
  __shared__ InputGate s_gate;
  __shared__ bool s_gated;  // s_task started before its event fired: it waits on s_gate
  // The next AOT task's op constants and the slot they go to (-1: none): the last warp copies
  // them while the task runs, 32 lanes at once (thread 0 alone would lengthen the hop); and
  // the AOT entry after that one into aot_next_slot (AotCursor), from s_pf_entry (null: none).
  __shared__ int s_pf_op, s_pf_slot;
  __shared__ const AotEntry* s_pf_entry;
  AotCursor aot;
  aot.begin = a.aot_offsets[w];
  aot.count = a.aot_offsets[w + 1] - aot.begin;
  aot.iterations = a.iterations;
  unsigned long long jit_head = 0;
  Pending pending;
  unsigned n_profiled = 0;
  unsigned long long t0 = 0, t_ready = 0;  // t_ready: MPK_HOP_STAMPS
  OpSlots slots;
  bool abandoned = false;  // a wait of the latest task (its gate or one inside it) was abandoned: leave
  if (threadIdx.x == 0) {
    aot.start(a);
    local_slot() = LocalTask{};
  }
  hop_clocks_begin();
  while (true) {
    if (threadIdx.x == 0) {
      s_gate.counter = nullptr;
      TaskInfo t = abandoned ? TaskInfo{kExit, -1} : next_task(a, w, aot, jit_head, pending, slots, s_gate);
      while (t.task != kExit && t.op < 0) {  // dummy tasks need no block: thread 0 completes them
        if (a.profile && n_profiled < static_cast<unsigned>(a.profile_capacity)) {
          const unsigned long long now = globaltimer_ns();
          a.profile[static_cast<long long>(w) * a.profile_capacity + n_profiled++] = ProfileRecord{t.task, sm_id(), now, now, 0, 0};
        }
        pending.add(a, t);
        t = next_task(a, w, aot, jit_head, pending, slots, s_gate);
      }
      s_task = t;
      s_gated = s_gate.counter != nullptr;
      // the task in hand, for the watchdog: in shared memory for the waits inside it, and in device
      // memory (a plain store, long done when the task's arrival releases) for the report
      launch_shared().task = t.task;
      if (t.task != kExit)
        a.running[w] = (static_cast<unsigned long long>(a.epoch) << 32) | static_cast<unsigned>(t.task);
      cp_async_wait_all();  // the prefetches landed (or must not land on a slot being staged)
      int slot = slots.find(t.op);
      s_staged = slot >= 0;
      if (slot < 0) {  // staged by mpk_execute_task, into the slot the latest task did not use
        slot = 1 - slots.last;
        slots.set(slot, t.op);
      }
      slots.last = s_slot = slot;
      s_pf_op = t.task != kExit && aot.left() ? aot.head.info.op : -1;
      s_pf_slot = slots.claim(s_pf_op);
      s_pf_entry = t.task != kExit ? aot.ask : nullptr;
#ifdef MPK_HOP_STAMPS
      if (a.profile) t0 = t_ready = globaltimer_ns();
#else
      if (a.profile) t0 = globaltimer_ns();
#endif
    }
    __syncthreads();
    const TaskInfo t = s_task;
    if (t.task == kExit) break;
    // land while t runs; by the last warp, as warp 0 polls t's gate (mpk_tasks/common.cuh: GateShare)
    if (threadIdx.x >= kThreads - 32) {
      const int lane = threadIdx.x - (kThreads - 32);
      if (s_pf_slot >= 0) mpk_prefetch_op(s_pf_op, s_pf_slot, lane, 32);
      if (s_pf_entry && lane < static_cast<int>(sizeof(AotEntry) / 16))
        cp_async16(reinterpret_cast<int4*>(&aot_next_slot()) + lane, reinterpret_cast<const int4*>(s_pf_entry) + lane);
    }
    mpk_execute_task(t.op, t.tile, s_slot, s_staged, s_gated ? &s_gate : nullptr);
    if (threadIdx.x >= kThreads - 32) cp_async_wait_all();  // the last warp's copies landed (long ago)
    __syncthreads();
    hop_mark(kHopEnd);
    if (threadIdx.x == 0) {
      if (s_gated) {
#ifdef MPK_DEBUG
        if (s_gate.open < 0) __trap();  // the task never opened its gate: it ran without waiting
#endif
        abandoned = s_gate.open == 0;
        if (abandoned) continue;  // the task returned without running: it owes no arrival
        t0 = s_gate.opened_ns;    // the profiled span starts when its inputs were ready
        // counters only grow: later tasks on this event that need no more start ungated
        aot.seen_event = s_gate.event;
        aot.seen_need = s_gate.seen;
      }
      // a wait inside the task was abandoned (the launch was stopped): its results are not
      // complete, so it owes no arrival
      if (launch_shared().abandoned) {
        abandoned = true;
        continue;
      }
      aot.landed();
      const unsigned long long t1 = a.profile ? globaltimer_ns() : 0;
      pending.add(a, t);
      // The arrival goes out now, not after the bookkeeping below and in next_task, unless the
      // next AOT task triggers the same event (its arrival then joins this one).
      if (!(aot.left() && aot.head.info.trig.id == t.trig.id)) pending.flush(a);
      // the profile record after the release, whose fence then does not wait for its store
      if (a.profile && n_profiled < static_cast<unsigned>(a.profile_capacity)) {
        a.profile[static_cast<long long>(w) * a.profile_capacity + n_profiled++] =
            ProfileRecord{t.task, sm_id(), t0, t1, t_ready, s_gated ? s_gate.reached_ns : 0};
      }
    }
  }
  if (threadIdx.x == 0) {
    volatile int* status = a.status + static_cast<long long>(w) * kStatusWords;
    if (status[kStState] != kStateAborted) status[kStState] = kStateExited;
    status[kStAotPos] = static_cast<int>(aot.pos());
    if (a.profile) a.profile_count[w] = n_profiled;
  }
  hop_clocks_end(w);
}

__device__ void scheduler_loop(const RuntimeArgs& a, int s) {
  __shared__ unsigned long long s_tails[kSchedWarpsPerCta][kMaxWorkersPerScheduler];
  unsigned long long* tails = s_tails[(threadIdx.x >> 5) % kSchedWarpsPerCta];
  const int lane = threadIdx.x & 31;
  const int S = a.active_schedulers, J = a.num_jit_events;
  const int mine = (a.num_workers - s + S - 1) / S;  // workers s, s + S, s + 2S, …
  for (int m = lane; m < mine; m += 32) tails[m] = 0;
  __syncwarp();
  volatile int* status = a.status + static_cast<long long>(a.num_workers + s) * kStatusWords;
  const unsigned long long* box = a.mailbox + static_cast<long long>(s) * J;
  int cursor = 0, loaded = -1;
  unsigned long long k = 1;  // the iteration the window's events belong to
  unsigned handled = 0;      // bit i: slot cursor + i dispatched this iteration (or kEventLocalJit)
  unsigned rr = 0;
  JitEvent ev{};
  TaskInfo head{};  // the first task of this scheduler's share of ev (loaded with the window)
  Spin spin;
  while (true) {
    if (loaded != cursor) {  // the window moved: load its events (static, off the hot path)
      ev = cursor + lane < J ? a.jit_events[cursor + lane] : JitEvent{-1, 0, 0, 0};
      if (ev.event >= 0 && ev.first_task + s < ev.last_task) head = a.task_infos[ev.first_task + s];
      loaded = cursor;
      handled |= __ballot_sync(0xffffffffu, ev.event >= 0 && (ev.flags & kEventLocalJit));  // their firers run them
    }
    const int advance = handled == 0xffffffffu ? 32 : __ffs(~handled) - 1;  // leading handled slots
    if (advance) {
      handled = advance == 32 ? 0u : handled >> advance;
      cursor += advance;
      if (cursor >= J) {  // every JIT event of iteration k handled: the next iteration's window
        cursor = 0;
        handled = 0;
        loaded = -1;
        if (++k > static_cast<unsigned long long>(a.iterations)) {  // nothing left to hand out
          if (lane == 0) status[kStState] = kStateExited;
          return;
        }
      }
      continue;
    }
    const bool open = ev.event >= 0 && !((handled >> lane) & 1u);
    const unsigned long long v = open ? load_relaxed(const_cast<unsigned long long*>(box) + cursor + lane) : 0;
    const unsigned done = lane == 0 ? dev_atomic_u32(*a.done).load(cuda::memory_order_relaxed) : 0u;
    const unsigned fired = __ballot_sync(0xffffffffu, open && v >= k);
    if (fired == 0) {
      if (lane == 0 && (spin.polls & 1023) == 1023) {  // lane 0 holds the window's first (unhandled) slot
        status[kStTask] = cursor;
        status[kStEvent] = ev.event;
        status[kStCountLo] = static_cast<int>(v);
        status[kStNeedLo] = static_cast<int>(k);
        status[kStAotPos] = static_cast<int>(handled);
        status[kStState] = kStateSchedWaiting;
      }
      int stop = lane == 0 && (done || spin.pause(a, status));
      if (__shfl_sync(0xffffffffu, stop, 0)) {
        if (lane == 0) status[kStState] = kStateExited;
        return;
      }
      continue;
    }
    spin.reset();
    fence_acquire();  // every lane: any of them may push this event's tasks
    __syncwarp();
    for (unsigned todo = fired; todo; todo &= todo - 1) {
      const int b = __ffs(todo) - 1;
      const int first = __shfl_sync(0xffffffffu, ev.first_task, b), last = __shfl_sync(0xffffffffu, ev.last_task, b);
      const bool all_jit = __shfl_sync(0xffffffffu, ev.flags, b) & kEventAllJit;
      TaskInfo first_info;  // lane b's head, for the lane that pushes task first + s: no load then
      {
        const int* from = reinterpret_cast<const int*>(&head);
        int* to = reinterpret_cast<int*>(&first_info);
#pragma unroll
        for (int f = 0; f < static_cast<int>(sizeof(TaskInfo) / 4); ++f) to[f] = __shfl_sync(0xffffffffu, from[f], b);
      }
      // this scheduler's share: tasks first + s, first + s + S, …; in chunks that give each lane
      // a different one of its workers, so lanes never share a ring tail
      const int count = last - first > s ? (last - first - s + S - 1) / S : 0;
      const int chunk = mine < 32 ? mine : 32;
      for (int c0 = 0; c0 < count; c0 += chunk) {
        const int i = c0 + lane;
        if (lane < chunk && i < count) {
          const int t = first + s + S * i;
          if (all_jit || (__ldg(&a.tasks[t].flags) & kTaskJit)) {
            const int m = static_cast<int>((rr + lane) % static_cast<unsigned>(mine));
            const int w = s + S * m;
            TaskInfo info = i == 0 ? first_info : a.task_infos[t];
            info.iter = static_cast<int>(k);  // its iteration: the worker can then fire a single-trigger event by a store
            Ring<TaskInfo>::at(a.jit_values, a.jit_seq, a.jit_head, a.jit_capacity, w).push(tails[m]++, info);
          }
        }
        rr += chunk;
        __syncwarp();
      }
    }
    handled |= fired;
  }
}

}  // namespace mpk

// The arguments travel by value in the kernel's parameter bank (__grid_constant__): the constant
// cache serves them, and the acquire operations that invalidate L1 on every hop cannot evict them.
extern "C" __global__ void __launch_bounds__(mpk::kThreads, 1)
    mpk_persistent_kernel(const __grid_constant__ mpk::RuntimeArgs args) {
  const mpk::RuntimeArgs& a = args;
  {
    const int* from = reinterpret_cast<const int*>(&args);
    int* to = reinterpret_cast<int*>(&mpk::shared_args());
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(mpk::RuntimeArgs) / 4); i += blockDim.x) to[i] = from[i];
    if (threadIdx.x == 0) {
      mpk::LaunchShared& l = mpk::launch_shared();
      l.abort_flag = a.abort_flag;
      l.status = static_cast<int>(blockIdx.x) < a.num_workers ? a.status + static_cast<long long>(blockIdx.x) * mpk::kStatusWords
                                                             : nullptr;
      l.epoch = a.epoch;
      l.task = -1;
      l.abandoned = 0;
    }
    mpk_stage_buffers();
    mpk::init_gate_share();
    __syncthreads();
  }
  if (static_cast<int>(blockIdx.x) < a.num_workers) {
    mpk::worker_loop(a, blockIdx.x);
    return;
  }
  const int warp = threadIdx.x >> 5;
  const int s = (blockIdx.x - a.num_workers) * mpk::kSchedWarpsPerCta + warp;
  if (warp < mpk::kSchedWarpsPerCta && s < a.active_schedulers && a.num_jit_events > 0) mpk::scheduler_loop(a, s);
}

#ifdef MPK_TILE_KERNEL
// Test wrapper: every tile of one op, one CTA per tile, no scheduling (task families alone).
// Built only on request: it doubles ptxas time.
extern "C" __global__ void __launch_bounds__(mpk::kThreads) mpk_tile_kernel(int op, int epoch) {
  if (threadIdx.x == 0) mpk::launch_shared() = mpk::LaunchShared{nullptr, nullptr, epoch, -1, 0};
  mpk_stage_buffers();
  mpk::init_gate_share();
  __syncthreads();
  mpk_execute_task(op, blockIdx.x, 0, false, nullptr);
}
#endif

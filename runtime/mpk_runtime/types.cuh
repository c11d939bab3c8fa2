// Device-side mirror of the tables (mpk/compiler/tables.py, version 2) and the runtime state
// one launch works on. Layouts here and in mpk/executors/gpu.py (ctypes) must agree.
#pragma once
#include <stdint.h>

namespace mpk {

struct TaskDesc {  // TASK_DTYPE, 20 bytes
  int op;          // -1: dummy task
  int tile;
  int dep_event;
  int trig_event;
  unsigned flags;  // bit 0: JIT
};

struct EventDesc {  // EVENT_DTYPE
  int num_triggers;
  int first_task;
  int last_task;
  unsigned flags;  // bit 0: global barrier (closes a JIT region); set by the host: bit 1 launches a JIT
                   // task, bit 2 only JIT tasks, bit 3 one JIT task, run by the worker that fires it
};

constexpr unsigned kTaskJit = 1u;
constexpr unsigned kEventHasJit = 2u;
constexpr unsigned kEventAllJit = 4u;
constexpr unsigned kEventLocalJit = 8u;

// Status words published to host-mapped memory from the back-off branch of a wait (watchdog;
// mpk/executors/report.py reads them). A worker waiting for its AOT head (kStateWaitingAot) or
// at a started task's gate (kStateGate): task, event, counter, needed count, AOT position, JIT
// head. A wait inside a task body (kStateInTask): task, TaskWait code (mpk_tasks/common.cuh).
// A scheduler warp (kStateSchedWaiting): JIT event index of its window's first slot, that
// event, the iteration it last fired in (mailbox), the iteration awaited, the handled mask.
enum StatusWord : int { kStState, kStTask, kStEvent, kStCountLo, kStNeedLo, kStAotPos, kStJitHead, kStSpins, kStatusWords };
enum WorkerState : int { kStateStarting = 0, kStateWaitingAot = 1, kStateIdle = 2, kStateExited = 3, kStateAborted = 4,
                         kStateGate = 5, kStateInTask = 6, kStateSchedWaiting = 7 };

// An event as its triggering tasks need it: arriving, deciding whether the arrival fired it,
// and telling the schedulers need no further lookup.
struct __align__(16) EventRef {
  int id, num_triggers, first_task, last_task;
  unsigned flags;
  int jit_index;  // index into RuntimeArgs::jit_events, -1 if the event launches no JIT task
  int pad[2];
};

// What a worker needs to run a task and report it done: one load, no dependent lookups.
struct __align__(16) TaskInfo {
  int task, op, tile;
  int iter;  // 1-based iteration, set when taken: AOT tasks by their worker, JIT tasks by the scheduler
  EventRef trig;
};

// A worker's AOT list entry (built by the host from the tables' placement): the task plus the
// event it waits on.
struct __align__(16) AotEntry {
  TaskInfo info;
  int dep, dep_triggers, pad[2];
};

struct ProfileRecord {
  int task;
  int sm;
  unsigned long long start_ns;  // its inputs were ready (a gated task: its gate opened)
  unsigned long long end_ns;    // its closing barrier passed (before the arrival)
  // builds with -DMPK_HOP_STAMPS only, else 0 (the stamps' code costs the worker loop registers,
  // so default builds leave it out): when the worker
  // had the task in hand (next_task returned) and when a gated task reached its gate
  unsigned long long ready_ns, gate_ns;
};

// A JIT event as the schedulers see it (host-built, in event order).
struct __align__(16) JitEvent {
  int event, first_task, last_task;
  unsigned flags;
};

struct RuntimeArgs {
  const TaskDesc* tasks;
  const EventDesc* events;
  unsigned long long* counters;      // per event; never reset within a launch
  const int* aot_offsets;            // per worker CSR into aot_entries: [w, w+1) (the tables' worker_offsets)
  const AotEntry* aot_entries;       // the tables' worker_tasks, in queue order
  const TaskInfo* task_infos;        // per task (schedulers copy them into JIT rings)
  const JitEvent* jit_events;        // the events that launch JIT tasks; EventRef.jit_index indexes them
  unsigned long long* mailbox;       // active_schedulers × num_jit_events: iteration in which each fired
  TaskInfo* jit_values;              // num_workers × jit_capacity: one ring per worker, one producer
  unsigned long long* jit_seq;       //   (the scheduler owning the worker: w % active_schedulers)
  unsigned long long* jit_head;      // per worker, stride 16: the consumer's head (debug checks)
  unsigned* done;                    // set once the last iteration's end event fired
  volatile int* status;              // host-mapped: kStatusWords per worker, then per scheduler
  volatile int* abort_flag;          // host-mapped: the latest launch (epoch) the watchdog stopped
  ProfileRecord* profile;            // null unless profiling: profile_capacity per worker
  unsigned long long* profile_count;
  unsigned long long* running;       // per worker: (epoch << 32) | task, stored when the worker starts a task
  int profile_capacity;
  int num_workers;
  int num_schedulers;                // scheduler warps launched
  int active_schedulers;             // min(num_schedulers, num_workers): the ones that own workers
  int num_tasks;
  int num_events;
  int num_jit_events;
  int start_jit_index;               // the start event's index in jit_events, or -1
  int start_event;
  int end_event;
  int iterations;
  int any_jit;                       // 0: no JIT task at all, workers skip the JIT ring
  int jit_capacity;                  // power of two
  int epoch;                         // this launch's number (mpk_tasks/common.cuh: report_bad_input)
};

}  // namespace mpk

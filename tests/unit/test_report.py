"""The watchdog's report (mpk/executors/report.py) from synthetic status rows: no CUDA."""

from __future__ import annotations

import numpy as np

from mpk.executors.report import (
    ABORTED,
    EXITED,
    GATE,
    IDLE,
    IN_TASK,
    SCHED_WAITING,
    STATUS_WORDS,
    WAITING_AOT,
    ReportTables,
    Snapshot,
    format_report,
)

# 6 tasks: 0 (dummy, start) → 1, 2 (op 'q_proj', tiles 0, 1) → event 2 → 3 (op 'attn') → 4 (op 'attn', JIT) → 5
TABLES = ReportTables(
    task_op=np.array([-1, 0, 0, 1, 1, -1]), task_tile=np.array([0, 0, 1, 0, 1, 0]),
    task_dep=np.array([0, 1, 1, 2, 3, 4]), task_trig=np.array([1, 2, 2, 3, 4, 5]),
    event_triggers=np.array([1, 1, 2, 1, 1, 1]), op_names=["q_proj", "attn"], op_kinds=["linear", "attention"],
    worker_queues=[[0, 1, 3], [2], [5]], jit_events=[4])


def _rows(n, **set_rows):
    rows = np.zeros((n, STATUS_WORDS), np.int32)
    for i, words in set_rows.items():
        rows[int(i[1:])] = words
    return rows


def test_a_worker_at_a_gate_names_the_task_the_event_and_its_triggers():
    # worker 0 waits at task 3's gate for event 2 (1 of 2 arrivals); worker 1 is inside task 2 (its
    # busy spin); worker 2 idle; one scheduler waiting for JIT event 4
    status = np.concatenate([
        _rows(3, w0=[GATE, 3, 2, 1, 2, 2, 0, 5], w1=[IN_TASK, 2, 2, 0, 0, 0, 0, 9], w2=[IDLE, 0, 0, 0, 0, 1, 0, 3]),
        _rows(1, w0=[SCHED_WAITING, 0, 4, 0, 1, 0, 0, 4])])
    snap = Snapshot(epoch=7, status=status, num_workers=3, running=np.array([(7 << 32) | 3, (7 << 32) | 2, 0]),
                    counters=np.array([1, 1, 1, 0, 0, 0]))
    text = format_report(TABLES, snap, timeout_s=2.0, iterations=1, exited=True)
    assert "launch 7) did not finish within 2.0 s (6 tasks, 1 iteration(s), 3 workers, 1 schedulers)" in text
    assert ("worker 0: stuck before task 3 (op 'attn' (attention) tile 0) at its input gate (the task started), "
            "AOT position 2; waits on event 2 (1/2 arrivals)") in text
    assert "worker 1: inside task 2 (op 'q_proj' (linear) tile 1), waiting on a busy spin in its body (9 back-offs)" in text
    assert "1 worker(s) idle with no AOT work left; others: none" in text
    assert "scheduler 0: waits for JIT event 4 (JIT index 0) to fire in iteration 1" in text
    assert "event 2: counter 1, needs 2 (fires at multiples of 2); waiting workers [0]" in text
    # its triggers: task 1 ran on worker 0 (which is past it), task 2's worker is inside it
    assert "2 task(s), 1 not known done" in text
    assert "task 2 (op 'q_proj' (linear) tile 1) on worker 1: its worker is inside it" in text
    assert "task 1 (op 'q_proj' (linear) tile 0) on worker 0: done" in text
    assert "stay usable" in text


def test_rows_of_an_older_launch_and_running_words():
    # worker 0's row is an older launch's (exited), but its running word says it started task 1 in
    # this launch: named as running; worker 1's running word is an older launch's: counted by state
    status = _rows(3, w0=[EXITED, 0, 0, 0, 0, 0, 0, 0], w1=[ABORTED, 0, 0, 0, 0, 0, 0, 0],
                   w2=[WAITING_AOT, 5, 4, 0, 1, 0, 3, 1])
    snap = Snapshot(epoch=9, status=status, num_workers=3, running=np.array([(9 << 32) | 1, (8 << 32) | 2, 0]))
    text = format_report(TABLES, snap, timeout_s=1.0, iterations=2, exited=False, stopped_with=1)
    assert "worker 0: running task 1 (op 'q_proj' (linear) tile 0) (started in this launch" in text
    assert "others: 1 aborted" in text
    assert "worker 2: stuck before task 5 (dummy) before taking it, AOT position 0, JIT queue head 3; " \
           "waits on event 4 (0/1 arrivals)" in text
    assert "events waited on (counters as the waiters last saw them)" in text
    assert "task 4 (op 'attn' (attention) tile 1) (JIT)" in text
    assert "did not exit" in text and "1 launch(es) queued behind it were stopped too" in text
    # a row left by a wait inside task 2, but the worker has started task 3 since: the row is stale
    status[0] = [IN_TASK, 2, 2, 0, 0, 0, 0, 4]
    snap.running[0] = (9 << 32) | 3
    text = format_report(TABLES, snap, timeout_s=1.0, iterations=2, exited=True)
    assert "worker 0: running task 3 (op 'attn' (attention) tile 0)" in text and "inside task 2" not in text


def test_an_event_no_task_triggers_and_an_unknown_task():
    tables = ReportTables(task_op=np.array([0]), task_tile=np.array([0]), task_dep=np.array([0]),
                          task_trig=np.array([1]), event_triggers=np.array([1, 1, 3]), op_names=["x"],
                          op_kinds=["pointwise"], worker_queues=[[0]])
    status = _rows(1, w0=[WAITING_AOT, 12, 2, 0, 3, 0, 0, 1])
    text = format_report(tables, Snapshot(epoch=1, status=status, num_workers=1), timeout_s=1.0, iterations=1,
                         exited=None)
    assert "task 12 (not in the tables)" in text and "triggered by no task (it can never fire)" in text

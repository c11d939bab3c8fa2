"""Typed errors and warnings. Every error message names the bad value and what was expected."""

from __future__ import annotations


class MpkError(Exception):
    """Base class of all mpk errors."""


class OptionError(MpkError, ValueError):
    """A ``torch.compile(..., options=…)`` entry is unknown or has a bad value."""


class ConfigError(MpkError, ValueError):
    """A model config (a Hugging Face ``config.json``) asks for what mpk's decoders do not compute."""


class UnsupportedOpError(MpkError):
    """The graph holds an ATen op (or an op/shape combination) mpk cannot lower."""


class CompileError(MpkError):
    """The compiler found the graph or a partition override inconsistent."""


class VerifyError(CompileError):
    """The tables' event graph does not order two tasks that touch one element (a reader after
    every writer of what it reads, writers of one element one after the other). ``writer`` and
    ``reader`` are the first such pair's linear task ids (for two writers: the earlier and the
    later one), ``buffer`` its buffer's name, ``element`` an element both touch, ``pairs``
    every unordered (writer, reader) pair found."""

    def __init__(self, message: str, writer: int = -1, reader: int = -1, buffer: str = "",
                 element: tuple = (), pairs: frozenset = frozenset()):
        super().__init__(message)
        self.writer, self.reader, self.buffer, self.element, self.pairs = writer, reader, buffer, element, pairs


class ShardingError(CompileError):
    """The tensor-parallel sharding pass (mpk.distributed.shard) cannot split the graph over the
    degree asked for: a size not divisible by it, or a projection it cannot classify."""


class ExecutorUnavailableError(MpkError):
    """The requested executor cannot run on this machine / in this build."""


class ScheduleError(MpkError):
    """An executor found the task tables violated at run time (deadlock or race)."""


class DeadlockError(ScheduleError):
    """Tasks remain but none can run: their dependent events never fire."""


class RaceError(ScheduleError):
    """A task read an element before its producer ran, or two tasks wrote one element."""


class BadInputError(MpkError, ValueError):
    """A graph input held a value its op cannot take (a token id outside the embedding table).
    The GPU executor raises it after the launch that found it, or, for a launch not waited on,
    at the next launch or wait; that launch's outputs are not valid."""


class NotSupportedError(MpkError, NotImplementedError):
    """An option asks for what mpk does not do yet (the message says what it does)."""


class WatchdogTimeout(MpkError):
    """A persistent kernel launch did not finish within ``timeout_s``; the message is the
    watchdog's report of each stuck worker (mpk.executors.gpu)."""


class DistributedError(MpkError):
    """Tensor parallelism could not start or a rank failed (mpk.distributed)."""


class NvshmemUnavailableError(DistributedError, ExecutorUnavailableError):
    """nvshmem4py is not installed, or NVSHMEM failed to initialise (the cause is chained)."""


class RankMismatchError(DistributedError):
    """The ranks of one tensor-parallel job disagree: another world size, or other compiled
    tables (``ranks`` lists the ranks whose tables differ from rank 0's)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class RankFailedError(DistributedError):
    """A rank of a tensor-parallel job died or stopped answering; ``rank`` names it and the
    message is the monitor's report."""

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank


# cuda/mpk_tasks/common.cuh's BadInputCode -> what the value was, what it had to be; the CPU
# paths word the same faults the same way
BAD_INPUTS = {1: ("token id", "the embedding table's {limit} rows [0, {limit})"),
              2: ("decode position (the sequence's length − 1)",
                  "the rope table's {limit} positions [0, {limit}): the page table must count the token being "
                  "decoded (PagedKVCache.grow(1) before each step) and stay within the model's max_len"),
              3: ("kv_indptr entry", "kv_indices' {limit} entries [0, {limit}], or below the entry before it "
                  "(kv_indptr's offsets must not decrease)"),
              4: ("kv_last_page_len", "1…{limit} (the page size) for a sequence with pages"),
              5: ("kv_indices entry (a page id)", "the cache's {limit} pages [0, {limit})"),
              6: ("index (gather / index_select / x[idx])",
                  "the {limit} entries of the dim it indexes, [0, {limit}) (x[idx] also takes [-{limit}, 0)); "
                  "the row is the element's row-major position in the result"),
              7: ("qo_indptr entry", "0…{limit} (the step's token rows), or breaks qo_indptr's order (it must start "
                  "at 0 and never decrease)"),
              8: ("new-row count (qo_indptr[row + 1] − qo_indptr[row])",
                  "0…{limit}, the sequence's length in the page table (which must count the step's new rows)"),
              9: ("position of a new row (its sequence's length − its new rows + its index among them)",
                  "the rope table's {limit} positions [0, {limit}): a sequence must stay within the model's max_len")}
BAD_TOKEN, BAD_POSITION, BAD_INDEX, BAD_QO_INDPTR, BAD_QO_LEN, BAD_ROW_POSITION = 1, 2, 6, 7, 8, 9


def bad_input_message(code: int, value: int, row: object, limit: int) -> str:
    """'<what> <value> at row <row> is outside <what it had to be>' for a BadInputCode."""
    what, expected = BAD_INPUTS.get(code, (f"value (code {code})", "the range its op takes ({limit})"))
    return f"{what} {value} at row {row} is outside {expected.format(limit=limit)}"


class PerformanceWarning(UserWarning):
    """mpk compiled the graph, but part of it runs a slow fallback (the warning says which and why)."""


class PrecisionWarning(UserWarning):
    """mpk compiled the graph, but part of it computes with less precision than eager PyTorch
    (the warning says which ops)."""

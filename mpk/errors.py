"""Typed errors (and the one warning). Every message names the bad value and what was expected."""

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


class PerformanceWarning(UserWarning):
    """mpk compiled the graph, but part of it runs a slow fallback (the warning says which and why)."""

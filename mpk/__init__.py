"""mpk: a mega-kernel compiler and persistent GPU runtime for PyTorch.

``torch.compile(model, backend="mpk", options={...})`` lowers a model into an SM-level task graph
and runs it as one persistent kernel (or, with ``executor="cpu"``, on the CPU reference
interpreter). See ``mpk.options.CompileOptions`` for the options.

``mpk.LLM``, ``mpk.SamplingParams`` and ``mpk.RequestOutput`` (offline generation, vLLM's
interface; ``mpk.engine``) load on first use, so that ``import mpk`` stays light.
"""

from mpk.backend import mpk_backend
from mpk.errors import (BadInputError, CompileError, ConfigError, DeadlockError, ExecutorUnavailableError, MpkError,
                        OptionError, RaceError, UnsupportedOpError, VerifyError, WatchdogTimeout)
from mpk.options import CompileOptions

__version__ = "0.1.0"
__all__ = ["mpk_backend", "CompileOptions", "MpkError", "OptionError", "UnsupportedOpError", "CompileError",
           "ExecutorUnavailableError", "DeadlockError", "RaceError", "BadInputError", "ConfigError", "VerifyError",
           "WatchdogTimeout", "__version__", "LLM", "SamplingParams", "RequestOutput"]

_ENGINE = {"LLM": "mpk.engine.llm", "SamplingParams": "mpk.engine.sampling", "RequestOutput": "mpk.engine.outputs"}


def __getattr__(name: str):
    if name in _ENGINE:
        import importlib

        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'mpk' has no attribute {name!r}")

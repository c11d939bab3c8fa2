"""Executors of the tables: the CPU reference interpreter and (``gpu.GpuExecutor``) the persistent GPU kernel."""

from mpk.executors.interpreter import Interpreter

__all__ = ["Interpreter"]

"""OpGraph → task graph → tables (steps 1–7 of docs/architecture.md)."""

from mpk.compiler.pipeline import CompiledGraph, CompileStats, compile_graph
from mpk.compiler.tables import TABLES_VERSION, Tables

__all__ = ["CompiledGraph", "CompileStats", "compile_graph", "Tables", "TABLES_VERSION"]

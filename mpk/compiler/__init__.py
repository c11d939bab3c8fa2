"""OpGraph → task graph → tables (DESIGN.md §1 steps 1–7)."""

from mpk.compiler.pipeline import CompiledGraph, CompileStats, compile_graph
from mpk.compiler.tables import TABLES_VERSION, Tables

__all__ = ["CompiledGraph", "CompileStats", "compile_graph", "Tables", "TABLES_VERSION"]

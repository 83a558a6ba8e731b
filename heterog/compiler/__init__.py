"""Strategy -> TaskGraph: replicas, re-layouts, gradient aggregation and memory effects.

See ``heterog.compiler.compile`` for the semantics (DESIGN.md section 3).
"""
from heterog.compiler.compile import CompiledPlan, TaskKind, compile_strategy

__all__ = ["CompiledPlan", "TaskKind", "compile_strategy"]

"""Strategy -> TaskGraph: replicas, re-layouts, gradient aggregation and memory effects.

See ``heterog.compiler.compile`` for the semantics (DESIGN.md section 3) and the phases.
"""
from heterog.compiler.compile import CompiledPlan, Compiler, TaskKind, compile_strategy

__all__ = ["CompiledPlan", "Compiler", "TaskKind", "compile_strategy"]

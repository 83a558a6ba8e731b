"""Strategy -> TaskGraph: replicas, re-layouts, gradient aggregation and memory effects.

``heterog.compiler.compile`` lists the modules and the phases; the semantics are in docs/design.md,
"Replication, re-layout and aggregation", "Parameter-server choice" and "Resources, memory and time".
"""
from heterog.compiler.compile import CompiledPlan, Compiler, TaskCategory, TaskKind, compile_strategy

__all__ = ["CompiledPlan", "Compiler", "TaskCategory", "TaskKind", "compile_strategy"]

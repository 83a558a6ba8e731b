"""The compiler's context (heterog.compiler.context) and the package's layering: each module imports only
the modules below it, so every phase takes the frozen context and the tables it reads, never a Compiler."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from heterog.compiler.context import CompileContext
from heterog.compiler.tasks import CATEGORIES, TaskCategory
from tests.compiler.helpers import linear_graph
from tests.compiler.test_compile import FakeCost, two_gpu
from tests.test_imports import import_graph

PACKAGE = Path(__file__).resolve().parents[2] / "heterog" / "compiler"
# bottom up: a module may import only modules before it in this list
LAYERS = ("shard_search", "tasks", "index", "context", "registries", "memory", "convert", "sharded_state", "offload",
          "shards", "coupled", "sync_stats", "ps", "place", "reshard", "emit", "recompute", "micro", "plan", "delta",
          "compile")


def test_the_layers_list_every_module_of_the_package():
    assert sorted(LAYERS) == sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_each_module_imports_only_modules_below_it_type_imports_counted():
    graph = import_graph(type_imports=True)
    upward = []
    for i, name in enumerate(LAYERS):
        for target, line in sorted(graph[f"heterog.compiler.{name}"].items()):
            if target.startswith("heterog.compiler.") and LAYERS.index(target.rsplit(".", 1)[1]) >= i:
                upward.append(f"heterog.compiler.{name} imports {target} (line {line})")
    assert not upward, "imports against the compiler's layers " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


@pytest.mark.parametrize("name", LAYERS)
def test_module_is_short_and_says_what_it_is_for(name):
    text = (PACKAGE / f"{name}.py").read_text()
    assert len(text.splitlines()) <= 600
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc.split("\n\n")[0].splitlines()) <= 2        # a summary of at most two lines


def test_categories_name_each_task_category_in_order():
    assert len(CATEGORIES) == len(TaskCategory)
    assert [CATEGORIES[c] for c in TaskCategory] == ["forward", "backward", "update", "input", "transfer",
                                                     "split/concat", "ps", "allreduce", "sync", "recompute",
                                                     "collective"]


def test_context_is_frozen_and_holds_the_cluster_resources():
    g, c = linear_graph(), two_gpu()
    ctx = CompileContext.of(g, c, FakeCost(c))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.n_devices = 3
    assert (ctx.n_devices, ctx.n_links, ctx.batch_size, ctx.nccl_resource) == (2, len(c.links), 8, -1)
    assert ctx.resources.n_tasks == 0 and ctx.resources.n_resources == 2 + len(c.links)
    names = ctx.resources.category_names
    assert [names[code] for code in ctx.category_codes] == list(CATEGORIES)
    assert [g.ops[o].name for o in ctx.resident_ops] == ["W"]


def test_serialized_collectives_add_one_stream_that_every_allreduce_holds():
    g, c = linear_graph(), two_gpu()
    ctx = CompileContext.of(g, c, FakeCost(c), serialize_collectives=True)
    assert ctx.nccl_resource == 2 + len(c.links) and ctx.resources.n_resources == 3 + len(c.links)


def test_allreduce_costs_are_computed_once_per_device_set():
    g, c = linear_graph(), two_gpu()
    ctx = CompileContext.of(g, c, FakeCost(c))
    costs = ctx.allreduce((0, 1))
    assert ctx.allreduce((0, 1)) is costs
    assert costs.names == ("ring",) and costs.hosts == ()
    # FakeCost: 2 (n - 1) / n * bytes * 1e-9 for every tensor
    np.testing.assert_allclose(costs.times_s, ctx.index.t_bytes * 1e-9)
    # the ring 0 -> 1 -> 0 holds the links of both directions, numbered after the 2 device resources
    assert costs.links == (tuple(sorted(2 + x for x in (*c.path(0, 1), *c.path(1, 0)))),)

"""Loss normalisers computed from the targets alone.

A mean negative log-likelihood (``F.cross_entropy``, ``F.nll_loss``) divides by its *total weight*, the
number of targets not equal to ``ignore_index``. ATen's ``nll_loss_forward`` returns it as a second output,
which the backward reads; in a traced step that makes every backward depend on the whole forward of the
loss, through its input's log-probabilities, although the count depends on the targets only. Under
micro-batches the exact step needs the count of the whole batch before any backward, so this false
dependency would hold every forward of every micro-batch before the first backward.

``split_loss_normalisers`` rewrites each read of that output into the same value computed from the targets
(``(target != ignore_index).sum()`` in the loss's dtype, exact for counts below 2**24): the backward then
waits for the forward of its own micro-batch and for a count over the inputs. Losses with class weights or
another reduction keep their node.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten
NLL_FORWARD = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
MEAN = 1                              # ATen's reduction code for "mean"


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else node


def split_loss_normalisers(gm: GraphModule) -> dict[Node, Node]:
    """Rewrite the total-weight reads of every unweighted mean ``nll_loss_forward`` in ``gm`` (module
    docstring); returns each new node -> the loss node it stands in for (for its phase and module path)."""
    made: dict[Node, Node] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in NLL_FORWARD:
            continue
        args = list(node.args) + [None] * (5 - len(node.args))
        self_, target, weight, reduction, ignore_index = args[:5]
        if weight is not None or reduction != MEAN or not isinstance(ignore_index, int):
            continue
        reads = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
        if not reads:
            continue
        dtype = _val(self_).dtype
        fake = _val(target).fake_mode if hasattr(_val(target), "fake_mode") else None
        with graph.inserting_before(node):
            mask = graph.call_function(aten.ne.Scalar, (target, ignore_index))
            count = graph.call_function(aten.sum.default, (mask,))
            total = graph.call_function(aten._to_copy.default, (count,), {"dtype": dtype})
        if fake is not None:
            with fake:
                mask.meta["val"] = aten.ne.Scalar(_val(target), ignore_index)
                count.meta["val"] = aten.sum.default(mask.meta["val"])
                total.meta["val"] = aten._to_copy.default(count.meta["val"], dtype=dtype)
        for read in reads:
            read.replace_all_uses_with(total)
            graph.erase_node(read)
        made.update({mask: node, count: node, total: node})
    if made:
        gm.recompile()
    return made

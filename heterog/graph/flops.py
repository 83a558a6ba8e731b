"""FLOPs of one traced ATen call at concrete shapes: ``torch.utils.flop_counter``'s formulas, with fixes and
additions, or a documented estimate (reported) where no formula exists."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Node

from heterog.graph.fusion import VIEW_OPS
from heterog.graph.tracing import Sizes

# Overload packets (names) whose estimated cost is one FLOP per element of the largest input.
REDUCTION_OPS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean", "norm",
    "linalg_vector_norm", "logsumexp", "argmax", "argmin", "any", "all", "cumsum", "cumprod",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "nll_loss_forward", "nll_loss2d_forward", "native_layer_norm", "native_layer_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "native_group_norm",
    "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward", "embedding_dense_backward",
})



def _extra_flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas that replace or extend torch.utils.flop_counter's, called with concrete shapes.

    - ``convolution_backward``: torch's weight-gradient term ignores groups (a depthwise convolution's
      is counted ``groups`` times too high); here grad_input = the transposed convolution of grad_output
      with the weight, grad_weight = as many multiply-adds as the forward convolution.
    - SDPA on CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its backward): torch's SDPA formulas.
    """
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    extra: dict[Any, Callable[..., int]] = {}

    def conv_backward(grad_out: Any, x: Any, w: Any, _bias: Any, _stride: Any, _padding: Any, _dilation: Any,
                      transposed: bool, _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                      out_val: Any = None, **kwargs: Any) -> int:
        flops = 0
        if output_mask[0]:
            flops += fc.conv_flop_count(grad_out, w, out_val[0], not transposed)
        if output_mask[1]:
            flops += fc.conv_flop_count(x, w, grad_out, transposed)
        return flops

    extra[aten.convolution_backward] = conv_backward
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        def fwd(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
            return fc.sdpa_flop_count(q, k, v)

        extra[aten._scaled_dot_product_flash_attention_for_cpu] = fwd
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        def bwd(go: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
            return fc.sdpa_backward_flop_count(go, q, k, v)

        extra[aten._scaled_dot_product_flash_attention_for_cpu_backward] = bwd
    return extra


class FlopCounter:
    """FLOPs of one fx node at concrete shapes: a registered formula or the documented estimate."""

    def __init__(self, sizes: Sizes) -> None:
        from torch.utils.flop_counter import flop_registry

        self.sizes = sizes
        self.registry = {**flop_registry, **_extra_flop_formulas()}
        self.estimated_targets: set[str] = set()

    def _concrete(self, a: Any) -> Any:
        if isinstance(a, Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return torch.Size(self.sizes.shape(val))
            return self._concrete(val)
        if isinstance(a, torch.Tensor):
            return torch.Size(self.sizes.shape(a))
        if isinstance(a, (list, tuple)):
            return type(a)(self._concrete(x) for x in a)
        if isinstance(a, dict):
            return {k: self._concrete(v) for k, v in a.items()}
        return self.sizes.value(a)

    def __call__(self, node: Node, target: str, in_numels: Sequence[int], out_numels: Sequence[int]
                 ) -> tuple[float, bool]:
        if target in VIEW_OPS:
            return 0.0, False
        packet = getattr(node.target, "overloadpacket", None)
        formula = self.registry.get(packet) if packet is not None else None
        if formula is not None:
            out_val = self._concrete(node.meta.get("val"))
            try:
                return float(formula(*self._concrete(node.args), **self._concrete(node.kwargs),
                                     out_val=out_val)), False
            except (TypeError, ValueError, IndexError, AttributeError):
                pass  # a formula that needs real tensors (CUDA attention kernels): estimate, reported below
        self.estimated_targets.add(target)
        name = packet.__name__ if packet is not None else target
        if name in REDUCTION_OPS and in_numels:
            return float(max(in_numels)), True
        return float(sum(out_numels)), True

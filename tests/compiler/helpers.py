"""Hand-made graphs and a transparent cost model for compiler tests."""
from __future__ import annotations

from heterog.graph.opgraph import Edge, Op, OpGraph


def linear_graph(batch: int = 8, d_in: int = 4, d_out: int = 2, param_scale: int = 1) -> OpGraph:
    """x @ W -> mean loss -> backward -> SGD update, as a capture would produce it.

    0 x (input)  1 W (param)  2 mm  3 loss  4 ones_like(loss)  5 grad_out  6 grad_W  7 update
    """
    pb = d_in * d_out * 4 * param_scale
    ops = [
        Op("x", "placeholder", "input", "forward", [[batch, d_in]], ["torch.float32"], [0],
           bytes_written=batch * d_in * 4, batch_bytes=batch * d_in * 4),
        Op("W", "placeholder", "param", "forward", [[d_in, d_out]], ["torch.float32"], [None],
           bytes_written=pb, param_bytes=pb, grad_bytes=pb, param="W"),
        Op("mm", "aten.mm.default", "compute", "forward", [[batch, d_out]], ["torch.float32"], [0],
           flops=2 * batch * d_in * d_out, bytes_read=batch * d_in * 4 + pb, bytes_written=batch * d_out * 4,
           batch_bytes=batch * (d_in + d_out) * 4),
        Op("loss", "aten.mean.default", "compute", "forward", [[]], ["torch.float32"], [None],
           flops=batch * d_out, bytes_read=batch * d_out * 4, bytes_written=4, batch_bytes=batch * d_out * 4),
        Op("ones", "aten.ones_like.default", "compute", "backward", [[]], ["torch.float32"], [None],
           flops=1, bytes_read=4, bytes_written=4),
        Op("gout", "aten.div.Scalar", "compute", "backward", [[batch, d_out]], ["torch.float32"], [0],
           flops=batch * d_out, bytes_read=4, bytes_written=batch * d_out * 4, batch_bytes=batch * d_out * 4),
        Op("gW", "aten.mm.default", "compute", "backward", [[d_in, d_out]], ["torch.float32"], [None],
           flops=2 * batch * d_in * d_out, bytes_read=batch * (d_in + d_out) * 4, bytes_written=pb,
           batch_bytes=batch * (d_in + d_out) * 4, param="W", is_grad=True),
        Op("upd", "aten.sub.Tensor", "compute", "update", [[d_in, d_out]], ["torch.float32"], [None],
           flops=2 * d_in * d_out, bytes_read=2 * pb, bytes_written=pb, param="W"),
    ]
    edges = [Edge(0, 2, batch * d_in * 4, 0), Edge(1, 2, pb, None), Edge(2, 3, batch * d_out * 4, 0),
             Edge(3, 4, 4, None), Edge(4, 5, 4, None), Edge(0, 6, batch * d_in * 4, 0),
             Edge(5, 6, batch * d_out * 4, 0), Edge(1, 7, pb, None), Edge(6, 7, pb, None)]
    return OpGraph("linear", batch, ops, edges)


def chain_graph(n_layers: int, param_bytes: int, batch: int = 4) -> OpGraph:
    """n layers, each with one parameter of ``param_bytes`` (forward only + one update per layer)."""
    ops, edges = [Op("x", "placeholder", "input", "forward", [[batch, 16]], ["torch.float32"], [0],
                     bytes_written=batch * 64, batch_bytes=batch * 64)], []
    prev = 0
    for i in range(n_layers):
        p = len(ops)
        ops.append(Op(f"W{i}", "placeholder", "param", "forward", [[param_bytes // 4]], ["torch.float32"], [None],
                      bytes_written=param_bytes, param_bytes=param_bytes, grad_bytes=0, param=f"W{i}"))
        ops.append(Op(f"f{i}", "aten.mul.Tensor", "compute", "forward", [[batch, 16]], ["torch.float32"], [0],
                      flops=batch * 16, bytes_read=batch * 64, bytes_written=batch * 64, batch_bytes=batch * 128))
        edges += [Edge(prev, p + 1, batch * 64, 0), Edge(p, p + 1, 64, None)]
        prev = p + 1
    return OpGraph(f"chain{n_layers}", batch, ops, edges)


def branches_graph(k: int, param_bytes: int, batch: int = 8) -> OpGraph:
    """``k`` independent ``linear_graph`` branches reading one input ``x``, each with its own weight of
    ``param_bytes``, loss, backward and SGD update (op names suffixed with the branch index)."""
    one = linear_graph(batch, d_in=param_bytes // 8, d_out=2)
    ops = [one.ops[0]]
    edges = []
    for i in range(k):
        base = len(ops) - 1                       # op j >= 1 of the branch lands at base + j
        for op in one.ops[1:]:
            ops.append(Op(**{**op.__dict__, "name": f"{op.name}{i}", "param": f"W{i}" if op.param else None}))
        for e in one.edges:
            src = 0 if e.src == 0 else base + e.src
            edges.append(Edge(src, base + e.dst, e.bytes, e.batch_dim))
    return OpGraph(f"branches{k}", batch, ops, edges)

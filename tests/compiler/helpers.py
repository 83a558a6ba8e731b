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


def pipeline_graph(n_layers: int, batch: int = 8, flops: float = 4.0, width: int = 16) -> OpGraph:
    """``n_layers`` layers h_i = f_i(h_{i-1}, W_i), a mean loss, and their backward: per layer one
    input-gradient op (``flops`` at the whole batch, like each forward op; it reads the layer's input, as
    a nonlinearity's backward does) and one weight-gradient op (no FLOPs), then an update per weight (no
    FLOPs). Layer i's ops are named ``f{i}``, ``bx{i}``, ``bw{i}``, ``upd{i}``, its weight ``W{i}``; the
    loss is ``loss``, the seed ``ones`` and ``gout`` (the loss gradient, which reads the last layer's
    output as a loss's backward does)."""
    act = batch * width * 4
    pb = width * width * 4
    ops = [Op("x", "placeholder", "input", "forward", [[batch, width]], ["torch.float32"], [0],
              bytes_written=act, batch_bytes=act)]
    edges: list[Edge] = []
    idx: dict[str, int] = {}

    def add(op: Op, *inputs: tuple[str | int, int | None]) -> int:
        ops.append(op)
        idx[op.name] = len(ops) - 1
        for src, bd in inputs:
            s = src if isinstance(src, int) else idx[src]
            edges.append(Edge(s, len(ops) - 1, act if bd is not None else max(ops[s].bytes_written, 4), bd))
        return len(ops) - 1

    prev: str | int = 0
    for i in range(n_layers):
        add(Op(f"W{i}", "placeholder", "param", "forward", [[width, width]], ["torch.float32"], [None],
               bytes_written=pb, param_bytes=pb, grad_bytes=pb, param=f"W{i}"))
        add(Op(f"f{i}", "aten.mm.default", "compute", "forward", [[batch, width]], ["torch.float32"], [0],
               flops=flops, bytes_read=act + pb, bytes_written=act, batch_bytes=2 * act), (prev, 0), (f"W{i}", None))
        prev = f"f{i}"
    add(Op("loss", "aten.mean.default", "compute", "forward", [[]], ["torch.float32"], [None],
           bytes_read=act, bytes_written=4, batch_bytes=act), (prev, 0))
    add(Op("ones", "aten.ones_like.default", "compute", "backward", [[]], ["torch.float32"], [None],
           bytes_read=4, bytes_written=4), ("loss", None))
    add(Op("gout", "aten.mul.Tensor", "compute", "backward", [[batch, width]], ["torch.float32"], [0],
           bytes_read=4 + act, bytes_written=act, batch_bytes=2 * act), ("ones", None), (prev, 0))
    grad: str = "gout"
    for i in reversed(range(n_layers)):
        src: str | int = f"f{i - 1}" if i else 0
        add(Op(f"bw{i}", "aten.mm.default", "compute", "backward", [[width, width]], ["torch.float32"], [None],
               bytes_read=2 * act, bytes_written=pb, batch_bytes=2 * act, param=f"W{i}", is_grad=True),
            (grad, 0), (src, 0))
        add(Op(f"bx{i}", "aten.mm.default", "compute", "backward", [[batch, width]], ["torch.float32"], [0],
               flops=flops, bytes_read=2 * act + pb, bytes_written=act, batch_bytes=3 * act),
            (grad, 0), (f"W{i}", None), (src, 0))
        grad = f"bx{i}"
    for i in range(n_layers):
        add(Op(f"upd{i}", "aten.sub.Tensor", "compute", "update", [[width, width]], ["torch.float32"], [None],
               bytes_read=2 * pb, bytes_written=pb, param=f"W{i}"), (f"W{i}", None), (f"bw{i}", None))
    return OpGraph(f"pipeline{n_layers}", batch, ops, edges)

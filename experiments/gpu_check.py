"""The simulator held to one real GPU. For bert_large (batch 16) and OPT-350M (one sequence of 2048
tokens), fp32 with Adam, it measures:

- the whole training step, against the single-device plan's simulated time and peak memory. Eager
  PyTorch gives the time and the allocator's peak; the runtime's interpreter gives its time;
- each op's kernels, timed by CUDA events inside whole steps, against the roofline by kind;
- the runtime profiler's per-op times (each with a synchronisation), and per layer for OPT-350M.

It also trains one plan with NCCL by processes that share the GPU, checked against single-process
training.

    python -m experiments.gpu_check --out DIR [--quick]

Runs where CUDA is visible (prints why not elsewhere). Each part is guarded: a failing part is recorded
with its error and the others still run. Writes ``DIR/gpu_check.json`` (every figure, the GPU's name,
library versions) and prints a short table; docs/results.md ("Real GPUs") quotes the figures with the
commit and date they were measured at.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

# OPT-350M as facebook/opt-350m configures it (hidden 1024, 24 layers, ffn 4096, 16 heads, vocabulary
# 50272, embeddings projected from 512), at the sequence length of Sailor's runs
OPT_350M = dict(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
                max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False)
SEQ_LEN = 2048


def build_opt_350m(batch_size: int | None = None) -> tuple[Any, dict[str, Any]]:
    """OPT-350M with random weights (no download), inputs of ``batch_size`` sequences of 2048 tokens."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    # eager attention: capture on the CPU would record the CPU's own SDPA kernel, which a GPU cannot run
    model = OPTForCausalLM(OPTConfig(**OPT_350M, attn_implementation="eager"))
    # transformers before 5.2x draws a layer-drop coin per layer even at layerdrop 0 (a comparison with a
    # random tensor, which capture refuses as value-dependent control flow): a threshold that every draw
    # passes takes the branch away without changing the model
    for layer_owner in (model.model.decoder,):
        layer_owner.layerdrop = _NeverDrop()
    ids = torch.randint(0, OPT_350M["vocab_size"], (int(batch_size or 1), SEQ_LEN))
    return model, {"input_ids": ids, "labels": ids}


class _NeverDrop:
    """A layer-drop probability of 0 that compares as a plain Python value with a tensor or a float."""

    def __gt__(self, other: object) -> bool:
        return False

    def __lt__(self, other: object) -> bool:
        return True

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return False


def gpu_cluster_yaml(directory: Path, n: int, gpu_type: str) -> Path:
    """A cluster of ``n`` devices of ``gpu_type`` in one server (ranks share the one GPU when n > 1)."""
    path = directory / f"gpu-{n}.yaml"
    path.write_text(f"name: gpu-{n}\nservers:\n  - name: node\n    gpus: [{{type: {gpu_type}, count: {n}}}]\n"
                    f"    intra: {{kind: nvlink, bandwidth: 360 GB/s, latency_us: 2}}\n"
                    f"    nic: {{bandwidth: 400 Gbit/s, latency_us: 5}}\n")
    return path


def environment() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), sm_count=p.multi_processor_count,
                   memory_bytes=int(p.total_memory), devices=torch.cuda.device_count())
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a version is information, not a requirement
            out["nccl"] = f"unknown ({exc})"
    return out


def op_times(ref: str, batch_size: int, cluster_path: Path, steps: int, warmup: int,
             layers: bool, backend: str = "nccl") -> dict[str, Any]:
    """Every compute op of ``ref`` at ``batch_size`` timed on the GPU (the runtime's own traced
    single-device run, ``OpProfiler``), against the roofline of the catalog's type for it."""
    from heterog.baselines.expert import block_layers
    from heterog.cluster import load_cluster
    from heterog.cost import CostModel
    from heterog.runtime.api import load_model
    from heterog.runtime.launcher import WorkerPool
    from heterog.runtime.profiler import OpProfiler

    t0 = time.perf_counter()
    model = load_model(ref, batch_size, optimizer="adam")
    capture_s = time.perf_counter() - t0
    cluster = load_cluster(str(cluster_path))
    pool = WorkerPool(1, backend, hang_timeout_s=300.0)
    try:
        prof = OpProfiler(model, cluster, pool, batch_sizes=[batch_size], steps=steps, warmup=warmup)
        prof.round()
    finally:
        pool.close()
    table = prof.fit()
    graph = model.graph
    roof = CostModel(cluster).full_batch_times(graph)[:, 0]
    meas = CostModel(cluster, table).full_batch_times(graph)[:, 0]
    compute = np.flatnonzero(graph.is_compute & (roof > 0))
    kinds: dict[str, list[int]] = {}
    for i in compute.tolist():
        kinds.setdefault(graph.ops[i].target.split(".")[1] if "." in graph.ops[i].target else graph.ops[i].target,
                         []).append(i)
    per_kind = sorted(({"kind": k, "ops": len(ix), "measured_s": float(meas[ix].sum()),
                        "roofline_s": float(roof[ix].sum())} for k, ix in kinds.items()),
                      key=lambda r: -r["measured_s"])
    ratio = meas[compute] / roof[compute]
    out: dict[str, Any] = {
        "model": ref, "batch_size": batch_size, "ops": int(compute.size), "capture_s": capture_s,
        "measured_compute_s": float(meas[compute].sum()), "roofline_compute_s": float(roof[compute].sum()),
        "median_ratio": float(np.median(ratio)), "p10_ratio": float(np.quantile(ratio, 0.1)),
        "p90_ratio": float(np.quantile(ratio, 0.9)), "per_kind": per_kind[:25],
    }
    out["whole_step"] = _guarded(lambda: whole_step(model, cluster, table, steps, warmup))
    out["kernels"] = _guarded(lambda: kernel_times(model, roof, compute, kinds, steps, warmup))
    if layers:
        layer_of, n_blocks = block_layers(graph)
        fwd = np.array([op.phase == "forward" for op in graph.ops])
        rows = []
        for j in range(n_blocks + 2):
            ix = compute[layer_of[compute] == j]
            fx = ix[fwd[ix]]
            rows.append({"layer": j, "measured_s": float(meas[ix].sum()), "roofline_s": float(roof[ix].sum()),
                         "measured_forward_s": float(meas[fx].sum()), "roofline_forward_s": float(roof[fx].sum())})
        out["layers"] = rows
    return out


def kernel_times(model: Any, roof: np.ndarray, compute: np.ndarray, kinds: dict[str, list[int]], steps: int,
                 warmup: int) -> dict[str, Any]:
    """Each op's kernels timed inside whole steps of the runtime's interpreter, by CUDA events recorded
    around them with no synchronisation between ops: the interpreter launches more slowly than the GPU
    runs (about 15 us an op), so the GPU starts each op as it comes and a pair of events brackets its own
    kernels. The median over steps per op, summed per kind, against the roofline. Values go after their
    last reader (``StepProgram.last_readers``). On a CPU: wall-clock per op (a dry run)."""
    import torch

    from heterog.runtime.kernel import Kernel

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    prog = model.prog
    step = _OnDevice(model, dev)
    kernels = [Kernel([prog.calls[n] for n in nodes], dev, prog.random) if nodes else None
               for nodes in prog.op_nodes]
    dying = prog.last_readers(keep=[*prog.outputs, *(node for _, node in prog.buffer_updates)])
    times: dict[int, list[float]] = {}
    for s in range(warmup + steps):
        env, draw = step.start(s)
        marks = []
        with torch.no_grad():
            for op, kernel in enumerate(kernels):
                if kernel is not None:
                    if cuda:
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        kernel(env, step.sym, draw)
                        b.record()
                        marks.append((op, a, b))
                    else:
                        t0 = time.perf_counter()
                        kernel(env, step.sym, draw)
                        marks.append((op, t0, time.perf_counter()))
                for n in dying[op]:
                    env.pop(n, None)
        if cuda:
            torch.cuda.synchronize()
        if s >= warmup:
            for op, a, b in marks:
                times.setdefault(op, []).append(a.elapsed_time(b) * 1e-3 if cuda else b - a)
        step.advance(env)
        del env
    median = np.zeros(len(prog.op_nodes))
    for op, ts in times.items():
        median[op] = float(np.median(ts))
    per_kind = sorted(({"kind": k, "ops": len(ix), "kernel_s": float(median[ix].sum()),
                        "roofline_s": float(roof[ix].sum())} for k, ix in kinds.items()),
                      key=lambda r: -r["kernel_s"])
    ratio = median[compute] / roof[compute]
    return {"device": str(dev), "steps": steps, "all_ops_s": float(median.sum()),
            "compute_s": float(median[compute].sum()), "roofline_compute_s": float(roof[compute].sum()),
            "median_ratio": float(np.median(ratio)), "p10_ratio": float(np.quantile(ratio, 0.1)),
            "p90_ratio": float(np.quantile(ratio, 0.9)), "per_kind": per_kind[:25]}


class _OnDevice:
    """The captured step's placeholders on ``dev``, carried from step to step: ``start(s)`` gives step s's
    values and draw, ``advance(env)`` takes the new parameters, state and written buffers from its end."""

    def __init__(self, model: Any, dev: Any) -> None:
        import torch

        prog = self.prog = model.prog
        self.n_p, self.n_b, self.n_s = len(model.params), len(model.buffers), len(model.state)
        init = model.initial_values()
        self.held = [init[ph].to(dev) for ph in prog.placeholders[:self.n_p + self.n_b + self.n_s]]
        self.inputs = [x.to(dev) for x in model.example_inputs]
        self.consts = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in prog.consts.items()}
        self.batch = prog.batch_of(self.inputs)
        self.sym = prog.sizes_at(self.batch)

    def start(self, s: int) -> tuple[dict[str, Any], Any]:
        env: dict[str, Any] = dict(zip(self.prog.placeholders, [*self.held, *self.inputs]))
        env.update(self.consts)
        return env, self.prog.draw(s, self.batch, range(self.batch)) if self.prog.random else None

    def advance(self, env: dict[str, Any]) -> None:
        n_p, n_b, n_s = self.n_p, self.n_b, self.n_s
        out = [env[n] for n in self.prog.outputs]
        buffers = self.held[n_p:n_p + n_b]
        for i, node in self.prog.buffer_updates:
            buffers[i] = env[node]
        self.held = [*out[1:1 + n_p], *buffers, *out[1 + n_p:1 + n_p + n_s]]


def _guarded(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - recorded, the part's other figures still come back
        return {"error": traceback.format_exc(limit=6)}


def whole_step(model: Any, cluster: Any, table: Any, steps: int, warmup: int) -> dict[str, Any]:
    """One training step on the GPU in this process, timed two ways, against the single-device plan's
    simulated iteration time (roofline, and the per-op times just measured) and peak memory:

    - ``eager``: the model as users train it, plain PyTorch (forward, the loss the capture takes,
      backward, ``torch.optim.Adam``): its mean time and peak allocated memory;
    - ``interpreter``: the captured step run whole by the runtime's kernel, no synchronisation between
      ops (its time only: it keeps every value of the step to the end, so its memory says nothing).
    """
    import torch

    from heterog import baselines
    from heterog.cost import CostModel
    from heterog.evaluate import simulate

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    strategy = baselines.run("ev-ar", model.graph, cluster)
    sims = {name: simulate(model.graph, cluster, strategy, cost=cost)
            for name, cost in (("roofline", None), ("measured_ops", CostModel(cluster, table)))}
    out: dict[str, Any] = {"device": str(dev)}
    for name, fn in (("eager", _eager_step), ("interpreter", _interpreted_step)):
        out[name] = _guarded(lambda fn=fn: fn(model, dev, steps, warmup))
        if dev.type == "cuda":
            torch.cuda.empty_cache()   # the step's tensors are gone with its frame
    return {**out,
            **{f"simulated_{k}_s": float(r.iteration_time_s) for k, r in sims.items()},
            "simulated_peak_bytes": int(max(sims["roofline"].peak_memory_bytes.values()))}


def _timed(dev: Any, steps: int, warmup: int, one: Any) -> dict[str, Any]:
    """``one(s)`` for steps 0 .. warmup + steps - 1, each timed to its last kernel; the peak memory
    allocated over them (CUDA)."""
    import torch

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        one(s)
        sync()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    out = {"step_s": float(np.mean(times)), "step_s_min": float(np.min(times)), "steps": len(times)}
    if cuda:
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def _eager_step(model: Any, dev: Any, steps: int, warmup: int) -> dict[str, Any]:
    import copy

    import torch

    from heterog.graph.tracing import select_loss

    module = copy.deepcopy(model.module).to(dev).train()
    args, kwargs = model.prog.input_spec.call_args([x.to(dev) for x in model.example_inputs])
    opt = torch.optim.Adam(module.parameters(), lr=model.prog.lr)

    def one(_: int) -> None:
        opt.zero_grad(set_to_none=True)
        select_loss(module(*args, **kwargs), model.name)[0].backward()
        opt.step()

    return _timed(dev, steps, warmup, one)


def _interpreted_step(model: Any, dev: Any, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from heterog.runtime.kernel import Kernel

    prog = model.prog
    step = _OnDevice(model, dev)
    kernel = Kernel([prog.calls[n] for n in prog.order], dev, prog.random)

    def one(s: int) -> None:
        env, draw = step.start(s)
        with torch.no_grad():
            kernel(env, step.sym, draw)
        step.advance(env)

    r = _timed(dev, steps, warmup, one)
    r.pop("peak_allocated_bytes", None)
    return r


def nccl_training(tmp: Path, gpu_type: str, steps: int) -> list[dict[str, Any]]:
    """A plan trained by two processes sharing the GPU with NCCL, against single-process training, once
    with NCCL's own multi-rank-per-GPU switch and once with the ranks posing as two hosts."""
    from heterog import baselines
    from heterog.cluster import load_cluster
    from heterog.runtime.api import compare_values, load_model, prepare, run_prepared, train_single_process

    cluster = load_cluster(str(gpu_cluster_yaml(tmp, 2, gpu_type)))
    results = []
    for variant in ("multi-rank", "distinct-hosts"):
        for method, ref, batch in (("ev-ar", "tiny_mlp", 16), ("random", "tiny_transformer", 8)):
            rec: dict[str, Any] = {"variant": variant, "method": method, "model": ref}
            os.environ["HETEROG_NCCL_DISTINCT_HOSTS"] = "1" if variant == "distinct-hosts" else "0"
            try:
                model = load_model(ref, batch)
                kw = {"seed": 1} if method == "random" else {}
                strategy = baselines.run(method, model.graph, cluster, **kw)
                prepared = prepare(model, cluster, strategy, backend="nccl")
                result = run_prepared(prepared, [model.example_inputs], steps, hang_timeout_s=120.0)
                _, want = train_single_process(model, [model.example_inputs], steps)
                ok, diff, _ = compare_values(model, result.values, want, rtol=1e-3, atol=1e-4)
                rec.update(equivalent=bool(ok), max_abs_param_diff=float(diff),
                           iteration_time_s=float(result.iteration_time_s),
                           simulated_s=float(prepared.simulated_iteration_time_s))
            except Exception as exc:  # noqa: BLE001 - recorded, the next variant still runs
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            results.append(rec)
            print(json.dumps(rec), flush=True)
    os.environ.pop("HETEROG_NCCL_DISTINCT_HOSTS", None)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for gpu_check.json")
    ap.add_argument("--gpu-type", default="H100", help="catalog type whose roofline is compared (default H100)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="small batches, for a dry run")
    ap.add_argument("--cpu", action="store_true", help="dry run of the op timing on CPU (gloo), no NCCL part")
    ap.add_argument("--parts", default="env,nccl,bert,opt", help="comma-separated parts to run")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"env": environment(), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(report["env"]), flush=True)
    if args.cpu:
        parts.discard("nccl")
    elif not report["env"]["cuda_available"]:
        print("no CUDA GPU visible: nothing to measure", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    one = gpu_cluster_yaml(tmp, 1, args.gpu_type)
    backend = "gloo" if args.cpu else "nccl"
    jobs = []
    if "bert" in parts:
        jobs.append(("bert_large", lambda: op_times("bert_large", 4 if args.quick else 16, one, args.steps, 3,
                                                    layers=False, backend=backend)))
    if "opt" in parts:
        # one sample per micro-batch, as Sailor's OPT-350M profiles: preparing a run probes the step's
        # scaling on 1 and 2 samples at once (heterog.runtime.scaling), which at sequence 2048 in fp32 with
        # eager attention already takes tens of GB of host memory; larger batches probe on 2 and 4
        for b in (1,):
            jobs.append((f"opt_350m_mbs{b}", lambda b=b: op_times("experiments/gpu_check.py:build_opt_350m", b, one,
                                                                  args.steps, 3, layers=True, backend=backend)))
    if "nccl" in parts:   # last: it was checked on a GPU before, the op times are what a short lease most needs
        jobs.append(("nccl", lambda: nccl_training(tmp, args.gpu_type, 3)))
    for name, fn in jobs:
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:  # noqa: BLE001 - recorded, the next part still runs
            report[name] = {"error": traceback.format_exc(limit=6)}
        report[name + "_wall_s"] = time.perf_counter() - t0
        report[name + "_host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # so far
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
        r = report[name]
        if isinstance(r, dict) and "measured_compute_s" in r:
            print(f"{name}: {r['ops']} ops, measured {r['measured_compute_s'] * 1e3:.1f} ms, roofline "
                  f"{r['roofline_compute_s'] * 1e3:.1f} ms, median op ratio {r['median_ratio']:.2f} "
                  f"(p10 {r['p10_ratio']:.2f}, p90 {r['p90_ratio']:.2f}), {report[name + '_wall_s']:.0f} s", flush=True)
        w = r.get("whole_step") if isinstance(r, dict) else None
        if isinstance(w, dict) and "simulated_roofline_s" in w:
            e, i = w["eager"], w["interpreter"]
            print(f"  one step: eager {e.get('step_s', float('nan')) * 1e3:.1f} ms, interpreter "
                  f"{i.get('step_s', float('nan')) * 1e3:.1f} ms; simulated: roofline "
                  f"{w['simulated_roofline_s'] * 1e3:.1f}, measured ops {w['simulated_measured_ops_s'] * 1e3:.1f}; "
                  f"eager peak {e.get('peak_allocated_bytes', 0) / 2**30:.2f} GiB, simulated "
                  f"{w['simulated_peak_bytes'] / 2**30:.2f}", flush=True)
        elif isinstance(w, dict):
            print(f"  whole step FAILED {w['error'][-600:]}", flush=True)
        kt = r.get("kernels") if isinstance(r, dict) else None
        if isinstance(kt, dict) and "compute_s" in kt:
            print(f"  kernels by events: {kt['compute_s'] * 1e3:.1f} ms of compute (roofline "
                  f"{kt['roofline_compute_s'] * 1e3:.1f}), median op ratio {kt['median_ratio']:.2f} (p10 "
                  f"{kt['p10_ratio']:.2f}, p90 {kt['p90_ratio']:.2f})", flush=True)
        elif isinstance(kt, dict):
            print(f"  kernels FAILED {kt['error'][-600:]}", flush=True)
        if isinstance(r, dict) and "error" in r:
            print(f"{name}: FAILED {r['error'][-800:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

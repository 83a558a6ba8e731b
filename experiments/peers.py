"""Run the Sailor repository's own simulator and planners (Sailor, its copy of Metis) in their own Python
environment and write their predictions and best plans as our JSON, so heterog can compare offline.

    python -m experiments.peers simulate --sailor-repo /tmp/sailor --python /tmp/sailor-venv/bin/python -o DIR
    python -m experiments.peers plan --sailor-repo /tmp/sailor --python /tmp/sailor-venv/bin/python -o DIR

The outer command runs in our environment; it starts this same file as a script under Sailor's Python
(``_driver``), which imports Sailor's code from ``--sailor-repo`` and prints nothing but writes one raw
JSON file. This module imports only the standard library at its top so that Sailor's Python can run it.
Sailor's code is never copied: the driver only calls it, with three run-time shims (see ``_shim_torch``,
``_sailor_layout`` and ``_sailor_cpp_planner``).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

SOURCE_REPO = "eth-easl/sailor"
SOURCE_COMMIT = "cf2c8e3"
VALIDATION_DIR = "sailor/Planner/simulations/validation"
SIM_DIR = "sailor/Planner/simulations"
# Which of Sailor's training configs each validation folder models (clariden/<model>/..., mit/... is OPT-350).
TRAINING_CONFIGS = {"OPT-350": "training_config_opt_350.json", "GPT-NEO": "training_config_gpt_neo27.json"}
# Heterogeneous GCP scenarios of Sailor's planner evaluation: (A100-40 GPUs, V100-16 GPUs), one zone.
DEFAULT_SCENARIOS = ((4, 4), (8, 8), (16, 16))
ZONE = "us-central1-a"
# Unit of each planner's ``iter_time``: Metis' cost model works in milliseconds, Sailor's in seconds.
PLANNER_TIME_UNIT_S = {"metis": 1e-3, "sailor": 1.0}
# Peer-plan files larger than this are written gzip-compressed (``write_peer_plan``).
MAX_PLAIN_BYTES = 100_000


# ----------------------------------------------------------------------------------------- driver side
# (runs under Sailor's Python with Sailor's repository on sys.path)

def _shim_torch() -> None:
    """Sailor's ``profiling/profile_utils.py`` imports torch at top for its GPU profiling hooks; the network
    formulas the simulator and planners use from it are pure Python, so an empty stand-in suffices."""
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.modules["torch"] = types.ModuleType("torch")


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence Sailor's prints, its C++ planner's included (file descriptor 1, not only sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(null)
        os.close(saved)


def _validation_plans(repo: Path) -> list[Path]:
    return sorted((repo / VALIDATION_DIR).rglob("plan_config_*.json"))


def _plan_meta(repo: Path, path: Path) -> tuple[str, str]:
    """(cluster, model folder) of a validation plan: clariden/<model>/N*/..., mit/N*/... (OPT-350)."""
    parts = path.relative_to(repo / VALIDATION_DIR).parts
    return parts[0], (parts[1] if parts[0] == "clariden" else "OPT-350")


def _driver_simulate(repo: Path, layout: Path) -> dict[str, Any]:
    """Sailor's validate.py ``simulate_sailor`` for every validation plan: time and per-GPU peak memory."""
    from sailor.Planner.simulations.runtime_simulator import Simulator

    sim = repo / SIM_DIR
    llm_info = json.loads((repo / "sailor/Planner/llm_info.json").read_text())
    profiles = json.loads((sim / "profiles_tmp.json").read_text())
    rows = []
    for path in _validation_plans(repo):
        cluster, model_dir = _plan_meta(repo, path)
        cfg_name = TRAINING_CONFIGS[model_dir]
        training = json.loads((sim / "configs" / cfg_name).read_text())
        plan = json.loads(path.read_text())
        training["global_batch_size"] = plan["gbs"]
        pipe = plan["pipeline_list"][0]
        sim_plan = {"pipeline_list": [{k: pipe[k] for k in ("num_stages", "layers_per_stage", "tmp_per_stage",
                                                                "dp")}], "mbs": plan["mbs"]}
        with _quiet():
            # validate.py passes fp16=False and builds one Simulator per plan; so do we
            simulator = Simulator(str(layout), training, llm_info, False, profiles, plan["zone"])
            time_s, _, _ = simulator.simulate_iteration_time(sim_plan)
            peak = max(simulator.get_memory_footprint_on_gpu(sim_plan, stage, tmp_cfg[1])
                       for stage in range(pipe["num_stages"]) for tmp_cfg in pipe["tmp_per_stage"][stage])
        gpus = sorted({vm[0] for stage in pipe["tmp_per_stage"] for cfg in stage for vm in cfg[0]})
        rows.append({"cluster": cluster, "model": training["model"], "file": str(path.relative_to(repo)),
                     "gpu_types": gpus, "gbs": plan["gbs"], "mbs": plan["mbs"], "pp": pipe["num_stages"],
                     "dp": pipe["dp"], "tp": [[cfg[1] for cfg in st] for st in pipe["tmp_per_stage"]],
                     "predicted_s": float(time_s), "predicted_peak_bytes": float(peak),
                     "measured_s": plan.get("real"), "measured_peak_bytes": plan.get("max_mem"),
                     "training_config": f"{SIM_DIR}/configs/{cfg_name}"})
    return {"plans": rows}


def _sailor_cpp_planner(repo: Path, build: Path) -> Path:
    """Compile Sailor's C++ planner (pybind11 + jsoncpp) into ``build`` for this Python; their Makefile
    hard-codes python3.10 headers, so we compile the same sources with this interpreter's flags."""
    import sysconfig

    import pybind11

    src = repo / "sailor/Planner/sailor_planner/cpp_src"
    sources = [src / "utils/read_json.cpp", src / "training.cpp", src / "planner_utils.cpp",
               src / "utils/network_utils.cpp", src / "planner.cpp"]
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(src.rglob("*.[ch]pp")))).hexdigest()[:12]
    build = build / digest  # one build per version of their sources
    build.mkdir(parents=True, exist_ok=True)
    target = build / f"libplanner{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.exists():
        cmd = ["g++", "-O3", "-fPIC", "-shared", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", *map(str, sources), "-ljsoncpp", "-o", str(target)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return target


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "item"):
        return value.item()  # numpy scalars
    if hasattr(value, "name"):
        return value.name  # Metis DeviceType enums
    return [_jsonable(v) for v in value]  # pybind11 vectors of Sailor's C++ planner


def _first_fitting(plans: list[dict[str, Any]], simulator: Any) -> tuple[int, dict[str, Any] | None]:
    """Sailor's simulator.py takes the first plan, in the planner's order, that check_config_fits."""
    for rank, plan in enumerate(plans):
        if simulator.check_config_fits(plan):
            return rank, plan
    return len(plans), None


def _driver_plan(repo: Path, layout: Path, scenarios: list[tuple[int, int]], planners: list[str],
                 build: Path, partial: Path) -> dict[str, Any]:
    """Sailor's simulations/simulator.py loop for one-step traces: each planner's best fitting plan."""
    from sailor.Planner.simulations.runtime_simulator import Simulator

    sim = repo / SIM_DIR
    basic = json.loads((sim / "configs/basic_cluster_config.json").read_text())
    training_path = sim / "configs" / TRAINING_CONFIGS["OPT-350"]
    training = json.loads(training_path.read_text())
    llm_info = json.loads((repo / "sailor/Planner/llm_info.json").read_text())
    profiles = json.loads((sim / "profiles_tmp.json").read_text())
    out: dict[str, Any] = {}
    for n_a100, n_v100 in scenarios:
        name = f"opt350_a100x{n_a100}_v100x{n_v100}"
        out[name] = {}
        for planner_name in planners:
            with _quiet():
                simulator = Simulator(str(layout), dict(training), llm_info, False, profiles, basic["zone"])
                start = time.time()
                if planner_name == "metis":
                    result = _run_metis(repo, training_path, basic, n_a100, n_v100, dict(training))
                else:
                    result = _run_sailor(repo, training_path, build, n_a100, n_v100, dict(training))
                result["search_s"] = time.time() - start
                rank, best = _first_fitting(result["sorted_plans"], simulator)
                result.update(n_plans=len(result["sorted_plans"]), best_rank=rank, best=best)
                if best is not None:
                    sim_time_s, _, _ = simulator.simulate_iteration_time(best)
                    result["sailor_simulated_s"] = float(sim_time_s)
            result["sorted_plans"] = result["sorted_plans"][:20]
            out[name][planner_name] = _jsonable(result)
            partial.write_text(json.dumps(out, indent=1))  # keep finished scenarios if a later one fails
            print(f"{name} {planner_name}: {result['n_plans']} plans in {result['search_s']:.1f}s", file=sys.stderr)
    return out


def _run_metis(repo: Path, training_path: Path, basic: dict, n_a100: int, n_v100: int,
               training: dict) -> dict[str, Any]:
    from sailor.Planner.baselines.Metis import metis_planner

    planner = metis_planner.MetisPlanner(str(repo / "sailor/Planner/baselines/Metis/profiles/OPT-350"),
                                         str(training_path))
    raw: list[Any] = []
    search = planner.cost_het_cluster

    def keep_raw(*args: Any) -> Any:  # Metis' own candidates before Sailor converts them
        costs = search(*args)
        raw.extend(costs)
        return costs

    planner.cost_het_cluster = keep_raw
    cluster: dict[str, Any] = {"zone": ZONE}
    for gpu, n in (("A100-40", n_a100), ("V100-16", n_v100)):
        per_node = basic[gpu]["gpus_per_node"]
        cluster[gpu] = {"num_nodes": n // per_node, "gpus_per_node": per_node,
                        "mem_per_gpu": basic[gpu]["mem_per_gpu"]}
    plans = planner.get_sorted_plans(cluster_config=cluster, training_config=training)
    fields = ("node_sequence", "device_groups", "strategies", "batches", "layer_partition",
              "num_repartition", "cost_s", "rank_map")
    raw_sorted = sorted(raw, key=lambda r: r[6])[:20]
    return {"sorted_plans": plans, "metis_raw_top": [dict(zip(fields, r)) for r in raw_sorted],
            "time_budget_s": metis_planner.TIME_BUDGET_SEC, "cluster_config": cluster}


def _run_sailor(repo: Path, training_path: Path, build: Path, n_a100: int, n_v100: int,
                training: dict) -> dict[str, Any]:
    lib = _sailor_cpp_planner(repo, build)
    sys.path.insert(0, str(lib.parent))
    from sailor.Planner.sailor_planner.cpp_src import planner as sailor_planner

    real_system = os.system
    os.system = lambda cmd: 0  # their __init__ runs `make` in their tree; we built the library above
    try:
        planner = sailor_planner.SailorPlanner(str(repo / "sailor/Planner/sailor_planner/profiles/OPT-350") + "/",
                                               str(training_path),
                                               str(repo / "sailor/Planner/sailor_planner/dummy_quotas_dict.json"),
                                               "throughput", False)
    finally:
        os.system = real_system
    cluster = {f"A100-40_{ZONE}": n_a100, f"V100-16_{ZONE}": n_v100, "max_cost": 0.0, "min_throughput": 0.0}
    plans = planner.get_sorted_plans(cluster_config=dict(cluster), training_config=training)
    return {"sorted_plans": plans, "cluster_config": cluster}


def _sailor_layout(repo: Path, root: Path) -> Path:
    """Sailor reads ``$SAILOR_PATH/sailor/sailor/...``: a folder whose ``sailor`` entry is the repository."""
    root.mkdir(parents=True, exist_ok=True)
    link = root / "sailor"
    if not link.exists():
        link.symlink_to(repo.resolve())
    return root


def _driver(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="peers _driver")
    p.add_argument("what", choices=["simulate", "plan"])
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--layout", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scenarios", default="")
    p.add_argument("--planners", default="metis,sailor")
    p.add_argument("--build", type=Path, required=True)
    a = p.parse_args(argv)
    _shim_torch()
    os.environ["SAILOR_PATH"] = str(a.layout)
    if a.what == "simulate":
        result = _driver_simulate(a.repo, a.layout)
    else:
        scen = [tuple(int(x) for x in s.split("+")) for s in a.scenarios.split(",")]
        result = _driver_plan(a.repo, a.layout, scen, a.planners.split(","), a.build, a.out)  # type: ignore[arg-type]
    a.out.write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------ our side

def _run_driver(args: argparse.Namespace, what: str, extra: list[str]) -> dict[str, Any]:
    from heterog.errors import HeterogError

    repo = Path(args.sailor_repo).resolve()
    if not (repo / VALIDATION_DIR).is_dir():
        raise HeterogError(f"--sailor-repo {repo} has no {VALIDATION_DIR} (expected eth-easl/sailor's root)")
    if not Path(args.python).exists():
        raise HeterogError(f"--python {args.python} does not exist (the Python of Sailor's environment)")
    with tempfile.TemporaryDirectory(prefix="sailor-peers-") as tmp:
        layout = _sailor_layout(repo, Path(tmp) / "root")
        raw = Path(tmp) / "raw.json"
        env = dict(os.environ, PYTHONPATH=str(repo), SAILOR_PATH=str(layout), PYTHONHASHSEED="0")  # Metis iterates sets
        cmd = [args.python, str(Path(__file__).resolve()), "_driver", what, "--repo", str(repo), "--layout",
               str(layout), "--out", str(raw), "--build", str(Path(args.build_dir).resolve()), *extra]
        proc = subprocess.run(cmd, env=env, cwd=tmp)
        if proc.returncode != 0:
            raise HeterogError(f"Sailor's code exited with status {proc.returncode}: {' '.join(cmd)}")
        return json.loads(raw.read_text())


def _source(args: argparse.Namespace) -> dict[str, str]:
    return {"repository": SOURCE_REPO, "commit": args.source_commit}


def simulate(args: argparse.Namespace) -> Path:
    """Sailor's simulator on every validation plan -> ``simulator_predictions.json`` with MAPE and tau."""
    raw = _run_driver(args, "simulate", [])
    plans = raw["plans"]
    result = {"source": _source(args), "command": "python -m experiments.peers simulate",
              "summary": summarise(plans), "plans": plans}
    out = Path(args.out) / "simulator_predictions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def plan(args: argparse.Namespace) -> Path:
    """Metis' and Sailor's planners on the A100+V100 scenarios -> ``peer_plans/<scenario>/<planner>.json``."""
    raw = _run_driver(args, "plan", ["--scenarios", args.scenarios, "--planners", args.planners])
    root = Path(args.out) / "peer_plans"
    for scenario, per_planner in raw.items():
        for planner_name, result in per_planner.items():
            best = result.get("best")
            doc = {"source": _source(args), "scenario": scenario, "planner": planner_name,
                   "model": "OPT-350", "global_batch_size": 1024, "zone": ZONE,
                   "search_s": result["search_s"], "n_plans": result["n_plans"],
                   "best_rank": result["best_rank"],
                   "planner_predicted_s": best["iter_time"] * PLANNER_TIME_UNIT_S[planner_name] if best else None,
                   "sailor_simulated_s": result.get("sailor_simulated_s"),
                   "plan_config": to_plan_config(best, 1024) if best else None,
                   "planner_output": {k: v for k, v in result.items()
                                      if k not in ("search_s", "n_plans", "best_rank", "sailor_simulated_s")}}
            write_peer_plan(root / scenario, planner_name, doc)
    return root


def write_peer_plan(folder: Path, planner_name: str, doc: dict[str, Any]) -> Path:
    """``<planner>.json``, or ``<planner>.json.gz`` (gzip, no timestamp) when the JSON exceeds
    ``MAX_PLAIN_BYTES``: a plan of hundreds of GPUs lists every replica of every stage, 20 times over, and
    compresses about a hundredfold. The other name's stale file is removed."""
    from heterog.atomic import atomic_write_bytes

    data = (json.dumps(doc, indent=1) + "\n").encode()
    name = f"{planner_name}.json"
    if len(data) > MAX_PLAIN_BYTES:
        data, name = gzip.compress(data, mtime=0), name + ".gz"
    path = atomic_write_bytes(folder / name, data)
    stale = folder / (name.removesuffix(".gz") if name.endswith(".gz") else name + ".gz")
    stale.unlink(missing_ok=True)
    return path


def to_plan_config(best: dict[str, Any], gbs: int) -> dict[str, Any]:
    """A planner's plan in Sailor's validation ``plan_config_*.json`` layout (no measured fields)."""
    pipe = best["pipeline_list"][0]
    return {"zone": ZONE, "pipeline_list": [{"num_stages": pipe["num_stages"],
                                             "layers_per_stage": pipe["layers_per_stage"],
                                             "tmp_per_stage": pipe["tmp_per_stage"], "dp": pipe["dp"]}],
            "mbs": best["mbs"], "gbs": gbs}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties counted as neither concordant nor discordant)."""
    conc = disc = tie_x = tie_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tie_x += 1
            elif dy == 0:
                tie_y += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tie_x) * (conc + disc + tie_y)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def summarise(plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cluster (and per cluster/model): MAPE (%) of time and peak memory, Kendall tau of time."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in plans:
        groups.setdefault(row["cluster"], []).append(row)
        groups.setdefault(f"{row['cluster']}/{row['model']}", []).append(row)
    out = {}
    for key, rows in sorted(groups.items()):
        def mape(pred: str, meas: str) -> float:
            return 100.0 * sum(abs(r[pred] - r[meas]) / r[meas] for r in rows) / len(rows)
        out[key] = {"n_plans": len(rows), "time_mape_pct": mape("predicted_s", "measured_s"),
                    "memory_mape_pct": mape("predicted_peak_bytes", "measured_peak_bytes"),
                    "time_kendall_tau": kendall_tau([r["predicted_s"] for r in rows],
                                                    [r["measured_s"] for r in rows])}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_driver"]:
        _driver(argv[1:])
        return 0
    from heterog.errors import HeterogError

    p = argparse.ArgumentParser(prog="python -m experiments.peers", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["simulate", "plan"])
    p.add_argument("--sailor-repo", required=True, help="root of an eth-easl/sailor checkout")
    p.add_argument("--python", required=True, help="Python of a venv with numpy, pandas, pybind11")
    p.add_argument("-o", "--out", required=True, help="output folder (e.g. experiments/data/sailor)")
    p.add_argument("--source-commit", default=SOURCE_COMMIT, help="commit of --sailor-repo, recorded")
    p.add_argument("--scenarios", default=",".join(f"{a}+{v}" for a, v in DEFAULT_SCENARIOS),
                   help="A100+V100 GPU counts, comma-separated (plan)")
    p.add_argument("--planners", default="metis,sailor", help="metis and/or sailor (plan)")
    p.add_argument("--build-dir", default=str(Path(tempfile.gettempdir()) / "sailor-planner-build"),
                   help="where Sailor's C++ planner is compiled once and reused (plan)")
    args = p.parse_args(argv)
    try:
        path = simulate(args) if args.what == "simulate" else plan(args)
    except HeterogError as exc:
        print(f"experiments.peers: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_driver"]:
        sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())

"""The command line: every bad input gives a one-line error naming the problem and exit code 2."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from heterog import baselines
from heterog.cli import main
from heterog.cluster import load_cluster
from heterog.graph import load_graph
from heterog.strategy import Strategy
from tests.compiler.helpers import linear_graph

PAPER = "paper-8gpu"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err                   # one line, no traceback
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    return linear_graph(batch=16).save(tmp_path / "linear.json")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_simulate_json_carries_the_contract_fields(capsys, graph_file):
    code, out, _ = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", PAPER, "--method", "ev-ar",
                           "--json")
    assert code == 0
    rec = json.loads(out)
    for key in ("method", "iteration_time_s", "oom", "peak_memory_bytes", "compute_time_s", "comm_time_s",
                "search_time_s"):
        assert key in rec
    assert rec["method"] == "ev-ar" and rec["iteration_time_s"] > 0 and len(rec["peak_memory_bytes"]) == 8


def test_cyclic_graph(capsys, tmp_path, graph_file):
    d = json.loads(graph_file.read_text())
    d["edges"].append([7, 0, 4, None, 0])          # update -> input closes a cycle
    bad = write(tmp_path / "cyclic.json", json.dumps(d))
    code, _, err = run_cli(capsys, "simulate", "--graph", str(bad), "--cluster", PAPER, "--method", "single")
    assert_clean_error(code, err, "cycle")


def test_truncated_graph_file(capsys, tmp_path, graph_file):
    data = gzip.compress(graph_file.read_bytes())
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(capsys, "simulate", "--graph", str(bad), "--cluster", PAPER, "--method", "single")
    assert_clean_error(code, err, "cut.json.gz", "truncated")


CLUSTER = """name: bad
servers:
  - name: s0
    gpus: [{gpu}]
    intra: {{kind: pcie, bandwidth: {bw}, latency_us: 5}}
    nic: {{bandwidth: 10 Gbit/s}}
  - name: s1
    gpus: [V100-16GB]
    intra: {{kind: pcie, bandwidth: 12 GB/s}}
    nic: {{bandwidth: {nic}}}
"""


@pytest.mark.parametrize("gpu,bw,nic,needle", [
    ("TPU-v9, V100-16GB", "12 GB/s", "10 Gbit/s", "TPU-v9"),
    ("V100-16GB, V100-16GB", "-3 GB/s", "10 Gbit/s", "bandwidth"),
    ("V100-16GB, V100-16GB", "0 GB/s", "10 Gbit/s", "bandwidth"),
    ("V100-16GB, V100-16GB", "12", "10 Gbit/s", "unit"),
    ("V100-16GB, V100-16GB", "12 GB/s", "0 Gbit/s", "servers[1].nic.bandwidth"),
])
def test_bad_cluster_files(capsys, tmp_path, graph_file, gpu, bw, nic, needle):
    c = write(tmp_path / "c.yaml", CLUSTER.format(gpu=gpu, bw=bw, nic=nic))
    code, _, err = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", str(c), "--method", "single")
    assert_clean_error(code, err, needle)


def test_disconnected_cluster(capsys, tmp_path, graph_file):
    text = CLUSTER.format(gpu="V100-16GB", bw="12 GB/s", nic="1 Gbit/s").replace("    nic: {bandwidth: 1 Gbit/s}\n", "")
    c = write(tmp_path / "c.yaml", text)
    code, _, err = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", str(c), "--method", "single")
    assert_clean_error(code, err, "s1")


def test_unknown_cluster_and_method(capsys, graph_file):
    code, _, err = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", "no-such", "--method", "single")
    assert_clean_error(code, err, "no-such")
    code, _, err = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", PAPER, "--method", "magic")
    assert_clean_error(code, err, "magic")


def test_strategy_for_another_graph_or_cluster(capsys, tmp_path, graph_file):
    s = tmp_path / "s.json"
    assert run_cli(capsys, "plan", "--graph", str(graph_file), "--cluster", PAPER, "--method", "cp-ar",
                   "-o", str(s))[0] == 0
    other = linear_graph(batch=8).save(tmp_path / "other.json")
    code, _, err = run_cli(capsys, "simulate", "--graph", str(other), "--cluster", PAPER, "--strategy", str(s))
    assert_clean_error(code, err, "strategy is for graph")
    code, _, err = run_cli(capsys, "simulate", "--graph", str(graph_file), "--cluster", "paper-12gpu",
                           "--strategy", str(s))
    assert_clean_error(code, err, "paper-8gpu", "paper-12gpu")


def test_planner_options_of_plan(capsys, tmp_path, graph_file):
    out = tmp_path / "s.json"
    plan = ("plan", "--graph", str(graph_file), "--cluster", PAPER, "--method", "mcmc", "-o", str(out))
    code, _, err = run_cli(capsys, *plan, "--option", "budget=30")
    assert_clean_error(code, err, "heterog plan: error: planner 'mcmc' takes no option 'budget' (its options: ",
                       "budget_s", "max_evals")
    assert not out.exists()
    code, _, err = run_cli(capsys, *plan, "--option", "max_evals")
    assert_clean_error(code, err, "--option takes NAME=VALUE, got 'max_evals'")
    code, _, err = run_cli(capsys, *plan, "--option", "seed=3")
    assert_clean_error(code, err, "--option seed: a shared planning option")
    code, out_json, _ = run_cli(capsys, *plan, "--option", "max_evals=30", "--option", "order=None", "--json")
    assert code == 0
    api = baselines.run("mcmc", load_graph(graph_file), load_cluster(PAPER), max_evals=30, order=None, seed=0)
    assert Strategy.load(out).meta["actions"] == api.meta["actions"]
    doc = json.loads(out_json)
    assert doc["iteration_time_s"] > 0 and doc["micro_batches"] == list(api.micro)
    assert doc["recomputed_groups"] == list(api.recompute)
    code, out_text, _ = run_cli(capsys, "plan", "--graph", str(graph_file), "--cluster", PAPER, "--method", "dpos",
                                "--option", "micro_batches=2", "-o", str(out))
    assert code == 0 and "2 micro-batches" in out_text and Strategy.load(out).n_micro == 2


def test_planner_option_values_read_as_literals_and_booleans():
    from heterog.cli.plan import planner_options

    assert planner_options(["splits=true", "x=False", "k=4", "order=None", "name=fifo"]) == \
        {"splits": True, "x": False, "k": 4, "order": None, "name": "fifo"}


def test_unknown_zoo_model_and_non_scalar_output(capsys, tmp_path):
    code, _, err = run_cli(capsys, "capture", "resnet9000", "-o", str(tmp_path / "g.json"))
    assert_clean_error(code, err, "resnet9000")
    model = write(tmp_path / "m.py", "import torch\n"
                  "def build(batch_size=4):\n"
                  "    lin = torch.nn.Linear(3, 2)\n"
                  "    return lin, (torch.randn(batch_size, 3),)\n")
    code, _, err = run_cli(capsys, "capture", f"{model}:build", "--no-cache", "-o", str(tmp_path / "g.json"))
    assert_clean_error(code, err, "scalar")
    assert not (tmp_path / "g.json").exists()


def test_console_script_exits_non_zero_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "heterog", "simulate", "--graph", str(tmp_path / "missing.json"),
                           "--cluster", PAPER, "--method", "single"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "missing.json" in proc.stderr


def test_run_trains_a_plan_split_beyond_the_batch_like_one_process(capsys, tmp_path):
    out = tmp_path / "s.json"
    code, _, _ = run_cli(capsys, "plan", "--graph", "tiny_mlp", "--cluster", "local-cpu-2", "--method", "mcmc",
                         "--option", "splits=true", "--option", "starts=['tp-even']", "--option", "max_evals=2",
                         "--batch-size", "6", "-o", str(out))
    assert code == 0 and any(c.split for c in Strategy.load(out).configs)
    code, stdout, _ = run_cli(capsys, "run", "--model", "tiny_mlp", "--batch-size", "6", "--cluster", "local-cpu-2",
                              "--strategy", str(out), "--steps", "2", "--check-equivalence", "--json")
    rec = json.loads(stdout)
    assert code == 0 and rec["equivalent"] is True and rec["max_abs_param_diff"] < 1e-5

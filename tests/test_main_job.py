"""Smoke tests of the `make run` job and `heterog bench` on small sizes (they must run end to end)."""
from __future__ import annotations

import json

from heterog.cli import main


def test_main_job_smoke(tmp_path, capsys):
    assert main(["main", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "best plan:" in out
    doc = json.loads((tmp_path / "comparison.json").read_text())
    methods = {r["method"] for r in doc["records"]}
    assert {"single", "ev-ps", "ev-ar", "cp-ps", "cp-ar", "dpos", "mcmc", "pesto-ilp", "agent"} <= methods
    for name in ("best_gantt.png", "best_trace.json", "report.md", "comparison_with_rank.json"):
        assert (tmp_path / name).stat().st_size > 0


def test_bench_quick_smoke(capsys):
    assert main(["bench", "--quick", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("sim_tasks_per_s", "sim_speedup_vs_reference", "eval_ms_bert_large_paper8",
                "eval_ms_bert_large_paper8_k4", "eval_ms_delta_bert_large_paper8",
                "mcmc_evals_per_s_bert_large_paper8", "search_speedup_2_workers"):
        assert key in doc
    assert doc["sim_tasks_per_s"] > 0 and doc["sim_speedup_vs_reference"] > 0
    assert doc["eval_ms_delta_quick"] > 0 and doc["mcmc_evals_per_s_quick"] > 0 and doc["eval_ms_quick_k4"] > 0
    assert doc["eval_ms_delta_quick_k4"] > 0
    # MCMC starts from every data-parallel plan and keeps the best under the evaluator's order: never slower
    assert doc["mcmc_speedup_vs_best_dp_quick"] >= 1.0 - 1e-12 and doc["mcmc_n_evals_quick"] > 0
    assert "mcmc_speedup_vs_best_dp_bert_large_paper8" in doc
    # the simulations are part of each evaluation: the rate they alone allow is a ceiling of the rate measured
    assert doc["mcmc_evals_per_s_simulation_only_quick"] >= doc["mcmc_evals_per_s_quick"]
    assert "mcmc_evals_per_s_simulation_only_bert_large_paper8" in doc
    assert doc["eval_ms_quick_split"] > 0 and doc["eval_tasks_split"] > 0 and "eval_ms_bert_large_paper8_split" in doc

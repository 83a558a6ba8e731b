"""The hydra application: the real config tree composes for every experiment, and each experiment
file runs once, shrunk (tiny graphs, a tiny policy, a few episodes, CPU): pretrain -> finetune ->
evaluate, plus training from scratch with PPO and resuming a run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents.checkpoint import load_checkpoint
from agents.networks import StrategyPolicy
from agents.trainer import TrainerSettings
from experiments.train import graph_specs, run
from heterog.errors import HeterogError

CONF = str(Path(__file__).resolve().parents[2] / "experiments" / "conf")
EXPERIMENTS = sorted(p.stem for p in Path(CONF, "experiment").glob("*.yaml"))
SHRINK = ["agent.hidden=16", "agent.gat_layers=1", "agent.gat_heads=2", "agent.txl_layers=1", "agent.txl_heads=2",
          "agent.segment_len=8", "agent.mem_len=8", "trainer.samples_per_graph=2", "trainer.explore_samples=0",
          "trainer.mutate_samples=1",
          "run.episodes=8", "run.budget_s=null", "run.eval_samples=4", "run.compare=[ev-ar,cp-ar]"]
TINY_SET = "run.graphs=[{model:tiny_mlp,batch_size:16},{model:tiny_cnn,batch_size:16}," \
           "{model:tiny_transformer,batch_size:16}]"


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_experiment_files_are_those_of_the_design():
    assert EXPERIMENTS == ["evaluate", "finetune", "pretrain", "pretrain_tokens", "pretrain_tokens_splits"]


@pytest.mark.parametrize("agent", ["small", "paper"])
@pytest.mark.parametrize("trainer", ["reinforce", "ppo"])
def test_config_groups_instantiate(agent, trainer):
    cfg = config([f"agent={agent}", f"trainer={trainer}", "seed=3"])
    settings = instantiate(cfg.trainer)
    assert isinstance(settings, TrainerSettings) and settings.algorithm == trainer and settings.seed == 3
    policy = instantiate(cfg.agent)(n_devices=8, seed=0)
    assert isinstance(policy, StrategyPolicy) and policy.n_actions == 12
    assert policy.config["hidden"] == {"small": 64, "paper": 256}[agent]
    assert policy.config["gat_layers"] == {"small": 2, "paper": 12}[agent]


def test_pretrain_holds_out_the_graph_groups_model():
    cfg = config(["experiment=pretrain", "graph=vgg19"])
    models = [s["model"] for s in graph_specs(cfg)]
    assert "vgg19" not in models and len(models) == len(cfg.run.graphs) - 1
    assert cfg.run.name == "pretrain" and cfg.cluster.name == "paper-8gpu"
    assert config(["experiment=finetune"]).run.needs_checkpoint is True


def test_every_experiment_runs_once(tmp_path):
    torch.set_num_threads(1)
    out = [f"output_dir={tmp_path}"]
    pre = run(config(["experiment=pretrain", "graph=tiny_transformer", TINY_SET, *SHRINK, *out]))
    assert set(pre["graphs"]) == {"tiny_mlp-b16", "tiny_cnn-b16"}          # tiny_transformer held out
    assert pre["episodes"] >= 8 and Path(pre["checkpoint"]).is_file()
    assert "-minus-tiny_transformer" in pre["run"] and "__paper-8gpu__seed0__" in pre["run"]
    ckpt = pre["checkpoint"]

    fine = run(config(["experiment=finetune", "graph=tiny_transformer", f"run.init_from={ckpt}", *SHRINK, *out]))
    entry = fine["graphs"]["tiny_transformer-b16"]
    assert fine["init_from"] == ckpt and entry["episodes"] == 8
    assert set(entry["baselines"]) == {"ev-ar", "cp-ar"} and entry["best_baseline"] in ("ev-ar", "cp-ar")
    assert entry["speedup_vs_best_baseline"] == pytest.approx(
        entry["baselines"][entry["best_baseline"]]["iteration_time_s"] / entry["best_iteration_time_s"])
    run_dir = Path(fine["run_dir"])
    assert (run_dir / "learning_curve.png").is_file() and (run_dir / "gantt_tiny_transformer-b16.png").is_file()
    assert json.loads((run_dir / "report.json").read_text())["run"] == fine["run"]
    tags = EventAccumulator(str(run_dir)).Reload().Tags()
    assert "charts/best_iteration_time_s/tiny_transformer-b16" in tags["scalars"]

    ev = run(config(["experiment=evaluate", "graph=tiny_mlp", f"run.init_from={ckpt}", *SHRINK, *out]))
    result = ev["evaluation"]["tiny_mlp-b16"]
    assert ev["rounds"] == 0 and ev["episodes"] == 5                        # greedy + 4 samples, no update
    assert result["best_iteration_time_s"] <= result["greedy_iteration_time_s"]
    before = load_checkpoint(ckpt)["policy_state"]
    assert all(torch.equal(v, load_checkpoint(ckpt)["policy_state"][k]) for k, v in before.items())


def test_pretrain_tokens_trains_the_shipped_kind_of_checkpoint_and_ships_it(tmp_path):
    """experiment=pretrain_tokens: the pretrain graphs, none held out, on paper-8gpu, paper-12gpu and
    gen-0 .. gen-5 with the device-token head; experiments.ship keeps its policy and provenance."""
    from agents.planner import plan
    from experiments.ship import main as ship_main
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    cfg = config(["experiment=pretrain_tokens"])
    assert cfg.run.holdout is None and cfg.agent.head == "tokens" and len(graph_specs(cfg)) == len(cfg.run.graphs)
    assert list(cfg.run.clusters) == ["paper-8gpu", "paper-12gpu"] and cfg.run.generated_clusters == 6
    torch.set_num_threads(1)
    pre = run(config(["experiment=pretrain_tokens", TINY_SET, "run.clusters=[local-cpu-2]",
                      "run.generated_clusters=1", *SHRINK, f"output_dir={tmp_path}"]))
    assert pre["clusters"] == ["local-cpu-2", "gen-0"]
    shipped = tmp_path / "shipped.pt"
    assert ship_main([pre["run_dir"], "--out", str(shipped)]) == 0
    state = load_checkpoint(shipped)
    assert set(state) == {"format", "version", "policy_config", "policy_state", "provenance"}
    assert "tiny_cnn-b16@gen-0" in state["provenance"]["tasks"] and state["provenance"]["counters"]["episodes"] >= 8
    graph = capture_model("tiny_mlp", 16)
    ev = Evaluator(graph, load_cluster("paper-12gpu"))       # a cluster it never saw
    assert plan(ev, checkpoint=shipped, budget_s=0, progress=False).meta["zero_shot"]
    fixed = run(config([f"output_dir={tmp_path}", "graph=tiny_mlp", *SHRINK]))
    assert ship_main([str(Path(fixed["checkpoint"]).parent), "--out", str(tmp_path / "fixed.pt")]) == 2
    assert not (tmp_path / "fixed.pt").exists()                          # a fixed head is not shipped


def test_pretrain_tokens_splits_trains_a_policy_with_split_actions(tmp_path):
    """experiment=pretrain_tokens_splits: pretrain_tokens with the split actions and big_embedding (Adam)
    among the graphs; its shipped policy plans with split actions."""
    from agents.planner import plan
    from experiments.ship import main as ship_main
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    cfg = config(["experiment=pretrain_tokens_splits"])
    assert cfg.agent.split_actions and cfg.agent.head == "tokens" and cfg.run.holdout is None
    assert {"model": "big_embedding", "batch_size": 8, "optimizer": "adam"} in [dict(g) for g in cfg.run.graphs]
    assert {"pipeline", "mcmc", "tp-server"} <= set(cfg.run.demonstrations) and cfg.trainer.extended_plans
    torch.set_num_threads(1)
    pre = run(config(["experiment=pretrain_tokens_splits", TINY_SET, "run.clusters=[local-cpu-2]",
                      "run.generated_clusters=0", "run.distill_epochs=1", "run.demonstrations=[ev-ar,dpos]",
                      *SHRINK, f"output_dir={tmp_path}"]))
    assert set(pre["demonstrations"]) and all(set(d) == {"ev-ar", "dpos"} for d in pre["demonstrations"].values())
    shipped = tmp_path / "splits.pt"
    assert ship_main([pre["run_dir"], "--out", str(shipped)]) == 0
    assert load_checkpoint(shipped)["policy_config"]["split_actions"] is True
    graph = capture_model("tiny_mlp", 16)
    ev = Evaluator(graph, load_cluster("paper-8gpu"))
    strategy = plan(ev, checkpoint=shipped, episodes=8, progress=False)
    if strategy.meta["extended_plans"]:     # a seed needed the extended actions: the plans have rows
        assert len(strategy.meta["actions"]) == (2 + 8) * ev.n_groups + 1
    else:
        assert len(strategy.meta["actions"]) == 2 * ev.n_groups + 1
        assert max(strategy.meta["actions"][:ev.n_groups]) < 3 * 8 + 6


def test_scratch_with_ppo_then_resume(tmp_path):
    torch.set_num_threads(1)
    out = [f"output_dir={tmp_path}", "graph=tiny_cnn", "trainer=ppo", "trainer.ppo_epochs=2", *SHRINK]
    first = run(config(out))
    assert first["experiment"] == "scratch" and first["rounds"] == 4
    resumed = run(config([*out, f"run.resume={first['checkpoint']}"]))
    assert resumed["rounds"] == 8 and resumed["episodes"] == 16
    assert resumed["graphs"]["tiny_cnn-b16"]["best_iteration_time_s"] <= \
        first["graphs"]["tiny_cnn-b16"]["best_iteration_time_s"]


@pytest.mark.parametrize("experiment", ["finetune", "evaluate"])
def test_finetune_and_evaluate_need_a_checkpoint(tmp_path, experiment):
    cfg = config([f"experiment={experiment}", "graph=tiny_mlp", f"output_dir={tmp_path}", *SHRINK])
    with pytest.raises(HeterogError, match=f"experiment {experiment} needs run.init_from=<checkpoint>"):
        run(cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_token_head_checkpoint_fine_tunes_on_a_cluster_of_another_size(tmp_path):
    """agent.head=tokens trained on paper-8gpu; its checkpoint starts a run on paper-12gpu (12 devices),
    where a fixed-head checkpoint is refused."""
    torch.set_num_threads(1)
    out = [f"output_dir={tmp_path}", "graph=tiny_mlp", *SHRINK]
    tokens = run(config([*out, "agent.head=tokens"]))
    assert load_checkpoint(tokens["checkpoint"])["policy_config"]["head"] == "tokens"
    fine = run(config(["experiment=finetune", "cluster=paper-12gpu", f"run.init_from={tokens['checkpoint']}", *out]))
    assert fine["cluster"] == "paper-12gpu" and fine["graphs"]["tiny_mlp-b16"]["episodes"] == 8
    fixed = run(config(out))
    with pytest.raises(HeterogError, match=r"\(8 devices\); this cluster needs 16 actions \(12 devices\)"):
        run(config(["experiment=finetune", "cluster=paper-12gpu", f"run.init_from={fixed['checkpoint']}", *out]))


def test_one_token_policy_trains_on_several_clusters(tmp_path):
    """run.clusters and run.generated_clusters: every graph on every cluster, one task per pair, the
    trainer drawing graphs_per_round of the pairs each round; a fixed head refuses mixed sizes."""
    torch.set_num_threads(1)
    out = [f"output_dir={tmp_path}", "graph=tiny_mlp", *SHRINK, "run.episodes=24", "trainer.graphs_per_round=2"]
    report = run(config([*out, "agent.head=tokens", "run.clusters=[local-cpu-2,paper-8gpu]",
                         "run.generated_clusters=1"]))
    assert report["clusters"] == ["local-cpu-2", "paper-8gpu", "gen-0"]
    assert "__local-cpu-2+paper-8gpu+gen-0__" in report["run"]
    names = {f"tiny_mlp-b16@{c}" for c in report["clusters"]}
    assert set(report["graphs"]) == names
    assert sum(g["episodes"] for g in report["graphs"].values()) >= 24
    assert all(g["episodes"] > 0 and Path(g["strategy"]).is_file() for g in report["graphs"].values())
    for entry in report["graphs"].values():
        assert set(entry["baselines"]) == {"ev-ar", "cp-ar"}
    with pytest.raises(HeterogError, match=r"clusters of \[2, 8\] devices need .*agent.head=tokens"):
        run(config([*out, "run.clusters=[local-cpu-2,paper-8gpu]"]))


def test_demonstrations_are_the_first_best_plans_of_every_task(tmp_path):
    """run.demonstrations: the planners' plans of each task are recorded before the first round; the task's
    best plan is never slower than the fastest of them, and the report lists them."""
    from heterog import planners
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    torch.set_num_threads(1)
    report = run(config(["graph=tiny_mlp", "run.demonstrations=[cp-ar,expert,cp-ps,pipeline]",
                         "run.demonstration_budget_s=1", *SHRINK, f"output_dir={tmp_path}"]))
    shown = report["demonstrations"]["tiny_mlp-b16"]
    # cp-ps's servers are beyond the policy's actions (rows of the extended ones): left out; what the pipeline
    # planner finds in its second depends on the machine
    assert {"cp-ar", "expert"} <= set(shown) <= {"cp-ar", "expert", "pipeline"}
    ev = Evaluator(capture_model("tiny_mlp", 16), load_cluster("paper-8gpu"))
    assert shown["cp-ar"] == pytest.approx(ev.iteration_time(planners.plan("cp-ar", evaluator=ev))[0])
    assert report["graphs"]["tiny_mlp-b16"]["best_iteration_time_s"] <= min(shown.values()) * (1 + 1e-12)
    assert run(config(["graph=tiny_mlp", *SHRINK, f"output_dir={tmp_path}"]))["demonstrations"] == {}


def test_mcmc_split_starts_are_demonstrations_where_the_policy_splits(tmp_path):
    """run.demonstrations may name MCMC's split starts (tp-server): with split actions each is recorded, at the
    time of the start's own plan, and the task's best plan is never slower; without split actions none is."""
    from heterog.baselines.mcmc import start_plan
    from heterog.cluster import load_cluster
    from heterog.evaluate import Evaluator
    from heterog.graph.cache import capture_model

    torch.set_num_threads(1)
    names = "run.demonstrations=[tp-server,cp-ar]"
    report = run(config(["graph=tiny_transformer", "agent.split_actions=true", names, *SHRINK,
                         f"output_dir={tmp_path}"]))
    shown = report["demonstrations"]["tiny_transformer-b16"]
    assert set(shown) == {"tp-server", "cp-ar"}
    ev = Evaluator(capture_model("tiny_transformer", 16), load_cluster("paper-8gpu"))
    plan, (seconds, _) = start_plan(ev, "tp-server", splits=True)
    assert shown["tp-server"] == pytest.approx(seconds) == pytest.approx(ev.iteration_time(plan)[0])
    assert shown["tp-server"] < shown["cp-ar"]
    assert report["graphs"]["tiny_transformer-b16"]["best_iteration_time_s"] <= shown["tp-server"] * (1 + 1e-12)
    plain = run(config(["graph=tiny_transformer", names, *SHRINK, f"output_dir={tmp_path}"]))
    assert set(plain["demonstrations"]["tiny_transformer-b16"]) == {"cp-ar"}

"""Search on Ray workers (heterog.parallel): one worker runs here without Ray; chains and rollouts give
the same results wherever they run; a two-node cluster on this machine takes the same jobs.

Tests marked ``ray`` start a local Ray cluster and are skipped, with the reason, where Ray cannot start.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from heterog.cluster import load_cluster
from heterog.errors import HeterogError
from heterog.evaluate import Evaluator
from heterog.graph.cache import capture_model
from heterog.parallel import Pool, make_pool


def test_one_worker_runs_here_and_never_imports_ray():
    code = ("import sys\n"
            "from heterog.baselines.mcmc import mcmc\n"
            "from heterog.evaluate import Evaluator\n"
            "from heterog.cluster import load_cluster\n"
            "from tests.baselines.helpers import gpu_cluster, layered_graph\n"
            "ev = Evaluator(layered_graph(3, 1 << 12), gpu_cluster(2))\n"
            "s = mcmc(ev, seed=0, max_evals=30, workers=1)\n"
            "print(s.meta['workers'], 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False"]
    pool = make_pool(1)
    assert type(pool) is Pool and not pool.remote and pool.n_workers == 1
    with pytest.raises(HeterogError, match="workers must be at least 1"):
        make_pool(0)


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster for this module (its address), or a skip saying why it could not start."""
    try:
        import ray

        from heterog.parallel import init_ray
        init_ray()
    except Exception as exc:  # noqa: BLE001 - any failure to start Ray is a reason to skip
        pytest.skip(f"Ray cannot start here: {type(exc).__name__}: {exc}")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny():
    return Evaluator(capture_model("tiny_transformer", 8), load_cluster("paper-8gpu"))


@pytest.mark.ray
def test_mcmc_finds_the_same_plan_here_and_on_one_or_two_ray_workers(ray_address, tiny):
    from heterog.baselines.mcmc import mcmc

    runs = {"here": mcmc(tiny, seed=5, max_evals=90),
            "ray x1": mcmc(tiny, seed=5, max_evals=90, workers=1, ray_address=ray_address),
            "ray x2": mcmc(tiny, seed=5, max_evals=90, workers=2),
            "ray x2 again": mcmc(tiny, seed=5, max_evals=90, workers=2)}
    here = runs["here"].meta
    for name, s in runs.items():
        assert s.meta["actions"] == here["actions"], name
        assert s.meta["best_cost_s"] == here["best_cost_s"], name
        assert [c["proposals"] for c in s.meta["chains"]] == [c["proposals"] for c in here["chains"]], name
    assert [runs[k].meta["workers"] for k in runs] == [1, 1, 2, 2]
    assert here["best_cost_s"] <= here["best_start_cost_s"]


@pytest.mark.ray
def test_the_agent_trains_alike_with_its_rollouts_on_two_ray_workers(ray_address, tiny):
    from agents.planner import plan

    here = plan(Evaluator(tiny.graph, tiny.cluster), episodes=64, seed=2, progress=False)
    ray2 = plan(Evaluator(tiny.graph, tiny.cluster), episodes=64, seed=2, progress=False, workers=2)
    assert ray2.meta["actions"] == here.meta["actions"]
    assert ray2.meta["best_iteration_time_s"] == here.meta["best_iteration_time_s"]
    assert ray2.meta["episodes"] == here.meta["episodes"] == 64


@pytest.mark.ray
def test_a_two_node_cluster_on_this_machine_runs_the_chains(ray_address, tiny):
    """Two Ray nodes of one CPU each (ray.cluster_utils, as on two machines): the two workers land on
    different nodes and the search finds what it finds here."""
    import ray
    from ray.cluster_utils import Cluster

    from heterog.baselines.mcmc import mcmc
    from heterog.parallel import RayPool

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with RayPool(2, cluster.address) as pool:
            nodes = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                             for a in pool.actors])
        assert len(set(nodes)) == 2
        s = mcmc(tiny, seed=5, max_evals=60, workers=2, ray_address=cluster.address)
        ray.shutdown()
        assert s.meta["actions"] == mcmc(tiny, seed=5, max_evals=60).meta["actions"]
    finally:
        ray.shutdown()
        cluster.shutdown()
        from heterog.parallel import init_ray
        init_ray()                                      # the module's local cluster again, for later tests

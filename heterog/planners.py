"""The one registry of planners: ``compare``, ``plan``, ``run``, the main job, ``get_runner`` and
``heterog.baselines.run`` all plan through ``plan(method, graph, cluster, **options)`` and list methods
with ``names()``.

A planner takes the shared options of ``OPTIONS`` it declares (the registry drops the others, so one call
can hand them to every method) and its own options, the keyword parameters of its ``plan`` (mcmc's
``max_evals``, dpos's ``replicas``, ...). Any other option is a HeterogError naming the planner and the
options it takes: a misspelled option fails, it is never ignored.

Built in: the classic planners of ``heterog.baselines`` (``baseline_planners``) and ``best-dp`` (the
fastest simulated DP baseline). Other packages add planners through the entry-point group
``heterog.planners``: the entry point's name is the method, its value (``module:attribute``) a
``Planner``. The learning agent is one (``agent = "agents.planner:PLANNER"`` in pyproject.toml), so
``heterog`` never imports ``agents``: the entry point names it, and it loads on first use. Entry points
come from the installed metadata: after declaring one, reinstall the project (``pip install -e .``;
``make`` does it when pyproject.toml changes).
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, TypeAlias

from heterog.errors import HeterogError
from heterog.strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from heterog.cluster.topology import Cluster
    from heterog.evaluator_protocol import PlanEvaluator
    from heterog.graph.opgraph import OpGraph

ENTRY_POINT_GROUP = "heterog.planners"
OPTIONS = ("budget_s", "seed", "checkpoint", "episodes", "workers", "ray_address", "progress")
AGENT_OPTIONS = {"checkpoint": "--agent", "episodes": "--episodes"}   # refused by planners that lack them
BEST_DP_CANDIDATES = ("ev-ps", "ev-ar", "cp-ps", "cp-ar", "single")
PlanFunction: TypeAlias = "Callable[Concatenate[PlanEvaluator, ...], Strategy]"   # plan(evaluator, **options)


def keyword_parameters(fn: Callable) -> list[str]:
    """The parameters of ``fn`` after its first (the evaluator) that can be given by keyword, in order."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


@dataclass(frozen=True)
class Planner:
    """A method: ``plan(evaluator, **options) -> Strategy``, ``evaluator`` a ``PlanEvaluator``
    (``heterog.evaluator_protocol``: all of an evaluator that a planner may read). ``options``: the shared
    options (names from ``OPTIONS``) it takes, the only shared ones ``plan`` passes it; its own options are
    the other keyword parameters of ``plan`` (``own_options``). ``default``: part of ``compare``'s default
    methods (the agent is not: it trains)."""

    name: str
    plan: PlanFunction
    options: frozenset[str] = frozenset()
    default: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"planner {self.name!r}: unknown options {unknown}; known: {list(OPTIONS)}")
        hidden = [p for p in keyword_parameters(self.plan) if p in OPTIONS and p not in self.options]
        if hidden:      # a parameter named after a shared option it does not declare could never be given
            raise ValueError(f"planner {self.name!r}: parameters {hidden} are shared options (OPTIONS) it does "
                             f"not declare; declare or rename them")

    @classmethod
    def of(cls, name: str, plan: PlanFunction, default: bool = True) -> Planner:
        """The planner ``plan``, taking the shared options among its parameters."""
        return cls(name, plan, frozenset(keyword_parameters(plan)) & frozenset(OPTIONS), default)

    @property
    def own_options(self) -> frozenset[str]:
        """The keyword parameters of ``plan`` that are not shared options (mcmc's ``max_evals``, ...)."""
        return frozenset(keyword_parameters(self.plan)) - frozenset(OPTIONS)

    def check_options(self, options: Mapping) -> None:
        """HeterogError naming the options this planner does not take (neither shared nor its own) and
        listing those it takes."""
        unknown = [k for k in options if k not in OPTIONS and k not in self.own_options]
        if unknown:
            takes = sorted(self.options | self.own_options)
            raise HeterogError(f"planner {self.name!r} takes no option{'s' if len(unknown) > 1 else ''} "
                               f"{', '.join(map(repr, unknown))} "
                               f"({'its options: ' + ', '.join(takes) if takes else 'it takes no options'})")


# ----------------------------------------------------------------------------- built-in planners
# baselines that compare runs only when named: lp-round is a check on the bound (a 30 s MILP), not a search
NOT_DEFAULT = frozenset({"lp-round"})


def baseline_planners() -> dict[str, PlanFunction]:
    """The classic planners of ``heterog.baselines`` by method, in the order ``names()`` lists them."""
    import heterog.baselines.basic as basic
    import heterog.baselines.dpos as dpos
    import heterog.baselines.expert as expert
    import heterog.baselines.lpround as lpround
    import heterog.baselines.mcmc as mcmc
    import heterog.baselines.pesto as pesto
    import heterog.baselines.pipeline as pipeline

    return {"single": basic.single, "ev-ps": basic.ev_ps, "ev-ar": basic.ev_ar, "cp-ps": basic.cp_ps,
            "cp-ar": basic.cp_ar, "expert": expert.expert, "dpos": dpos.dpos, "os-dpos": dpos.os_dpos,
            "pesto-ilp": pesto.pesto, "pipeline": pipeline.pipeline, "mcmc": mcmc.mcmc, "random": basic.random_plan,
            "lp-round": lpround.lp_round}


def best_dp(ev: PlanEvaluator) -> Strategy:
    """The fastest simulated of the data-parallel baselines and single (``BEST_DP_CANDIDATES``; ties: the
    first; compared by (iteration time, OOM))."""
    best = min((plan(name, evaluator=ev) for name in BEST_DP_CANDIDATES), key=ev.iteration_time)
    best.meta["chosen_from"] = list(BEST_DP_CANDIDATES)
    return best


def _builtin() -> dict[str, Planner]:
    out = {name: Planner.of(name, fn, default=name not in NOT_DEFAULT) for name, fn in baseline_planners().items()}
    out["best-dp"] = Planner("best-dp", best_dp, default=False)
    return out


def _plugins() -> dict:
    """Entry points of the ``heterog.planners`` group by name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


# ----------------------------------------------------------------------------- the registry
def names() -> list[str]:
    """Every method: the baselines (in their order), best-dp, then the plugins' planners."""
    out = list(_builtin())
    return out + [n for n in _plugins() if n not in out]


def get(name: str) -> Planner:
    """The planner ``name`` (a plugin loads here); HeterogError naming the known methods otherwise."""
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    ep = _plugins().get(name)
    if ep is None:
        raise HeterogError(f"unknown method {name!r}; known: {', '.join(names())}")
    try:
        planner = ep.load()
    except ImportError as exc:
        raise HeterogError(f"{name} planner not available ({ep.value}: {exc})") from None
    if not isinstance(planner, Planner) or planner.name != name:
        raise HeterogError(f"entry point {name!r} of {ENTRY_POINT_GROUP!r} ({ep.value}) is not a Planner named "
                           f"{name!r}")
    return planner


def default_methods() -> list[str]:
    """The methods ``compare`` runs when none are named: every planner but those that train (the agent)
    and best-dp (a pick among the others)."""
    return [n for n, planner in _builtin().items() if planner.default]


def parse_methods(methods: str | Sequence[str] | None) -> list[str]:
    """``"a,b,c"`` or a list -> validated method names (duplicates dropped); None -> ``default_methods()``."""
    if methods is None:
        return default_methods()
    listed = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if str(m).strip()]
    if not listed:
        raise HeterogError("no methods given (e.g. --methods cp-ar,dpos,mcmc)")
    known = names()
    bad = [m for m in listed if m not in known]
    if bad:
        raise HeterogError(f"unknown method{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                           f"known: {', '.join(known)}")
    return list(dict.fromkeys(listed))


def plan(method: str, graph: OpGraph | None = None, cluster: Cluster | None = None, *,
         evaluator: PlanEvaluator | None = None, **options: Any) -> Strategy:
    """The strategy of ``method`` for ``graph`` on ``cluster`` (or ``evaluator``'s), with its method (the
    planner's name, or the one best-dp picked) and ``search_time_s`` (meta) set.

    ``options``: the shared ones (``OPTIONS``): ``budget_s`` goes to the searches, ``seed`` to every planner
    that draws random numbers, ``checkpoint``/``episodes`` to the agent only (refused elsewhere),
    ``workers`` and ``ray_address`` to the searches that fan out to Ray workers (``heterog.parallel``),
    ``progress`` to planners that show one; a planner gets those it takes, None means its own default. And
    the planner's own (``Planner.own_options``), passed as given. Any other option is a HeterogError.
    """
    planner = get(method)
    planner.check_options(options)
    budget_s = options.get("budget_s")
    if budget_s is not None and (budget_s < 0 or (budget_s == 0 and "checkpoint" not in planner.options)):
        raise HeterogError(f"budget must be positive, got {budget_s} s (0 means zero-shot, for the agent "
                           f"with its pretrained checkpoint)")
    refused = [flag for key, flag in AGENT_OPTIONS.items()
               if options.get(key) is not None and key not in planner.options]
    if refused:
        raise HeterogError(f"{' and '.join(refused)} appl{'y' if len(refused) > 1 else 'ies'} to the agent only, "
                           f"not to method {method!r}")
    if evaluator is None:
        from heterog.evaluate import Evaluator

        if graph is None or cluster is None:
            raise HeterogError(f"planning {method!r} needs a graph and a cluster, or an evaluator")
        evaluator = Evaluator(graph, cluster)
    given = {k: v for k, v in options.items()
             if k in planner.own_options or (v is not None and k in planner.options)}
    t0 = time.perf_counter()
    strategy = planner.plan(evaluator, **given)
    strategy.method = strategy.method or method         # a pick among planners (best-dp) names the one picked
    strategy.meta.setdefault("search_time_s", time.perf_counter() - t0)
    return strategy


__all__ = ["BEST_DP_CANDIDATES", "ENTRY_POINT_GROUP", "OPTIONS", "Planner", "baseline_planners", "best_dp",
           "default_methods", "get", "keyword_parameters", "names", "parse_methods", "plan"]

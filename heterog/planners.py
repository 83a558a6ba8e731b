"""The one registry of planners: ``compare``, ``plan``, ``run``, the main job and ``get_runner`` all plan
through ``plan(method, graph, cluster, **options)`` and list methods with ``names()``.

Built in: the classic planners of ``heterog.baselines`` and ``best-dp`` (the fastest simulated DP
baseline). Other packages add planners through the entry-point group ``heterog.planners``: the entry
point's name is the method, its value (``module:attribute``) a ``Planner``. The learning agent is one
(``agent = "agents.planner:PLANNER"`` in pyproject.toml), so ``heterog`` never imports ``agents``:
the entry point names it, and it loads on first use. Entry points come from the installed metadata:
after declaring one, reinstall the project (``pip install -e .``; ``make`` does it when pyproject.toml
changes).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from heterog.errors import HeterogError
from heterog.strategy import Strategy

ENTRY_POINT_GROUP = "heterog.planners"
OPTIONS = ("budget_s", "seed", "checkpoint", "episodes", "workers", "ray_address", "progress")
OWN_OPTIONS = {"checkpoint": "--agent", "episodes": "--episodes"}   # refused by planners that lack them
BEST_DP_CANDIDATES = ("ev-ps", "ev-ar", "cp-ps", "cp-ar", "single")
FAN_OUT = frozenset({"workers", "ray_address"})


@dataclass(frozen=True)
class Planner:
    """A method: ``plan(evaluator, **options) -> Strategy`` with the ``options`` (names from ``OPTIONS``)
    it takes; ``plan`` passes it only those. ``default``: part of ``compare``'s default methods (the
    agent is not: it trains)."""

    name: str
    plan: Callable[..., Strategy]
    options: frozenset[str] = frozenset()
    default: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"planner {self.name!r}: unknown options {unknown}; known: {list(OPTIONS)}")


# ----------------------------------------------------------------------------- built-in planners
# baselines that compare runs only when named: lp-round is a check on the bound (a 30 s MILP), not a search
NOT_DEFAULT = frozenset({"lp-round"})


def _baseline(name: str) -> Planner:
    from heterog import baselines

    def run(ev, **options) -> Strategy:
        return baselines.run(name, ev.graph, ev.cluster, evaluator=ev, **options)

    fan_out = FAN_OUT if name == "mcmc" else frozenset()     # chains on Ray workers (heterog.parallel)
    return Planner(name, run, frozenset({"budget_s", "seed"}) | fan_out, default=name not in NOT_DEFAULT)


def best_dp(ev) -> Strategy:
    """The fastest simulated of the data-parallel baselines and single (``BEST_DP_CANDIDATES``)."""
    from heterog import baselines

    best = None
    for name in BEST_DP_CANDIDATES:
        s = baselines.run(name, ev.graph, ev.cluster, evaluator=ev)
        t = ev.iteration_time(s)
        if best is None or t < best[0]:
            best = (t, s)
    best[1].meta["chosen_from"] = list(BEST_DP_CANDIDATES)
    return best[1]


def _builtin() -> dict[str, Callable[[], Planner]]:
    from heterog import baselines

    out: dict[str, Callable[[], Planner]] = {name: (lambda n=name: _baseline(n)) for name in baselines.names()}
    out["best-dp"] = lambda: Planner("best-dp", best_dp, default=False)
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
        return builtin[name]()
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
    builtin = _builtin()
    return [n for n in builtin if builtin[n]().default]


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


def plan(method: str, graph=None, cluster=None, *, evaluator=None, **options) -> Strategy:
    """The strategy of ``method`` for ``graph`` on ``cluster`` (or ``evaluator``'s), with its method (the
    planner's name, or the one best-dp picked) and ``search_time_s`` (meta) set.

    ``options`` (``OPTIONS``): ``budget_s`` goes to the searches, ``seed`` to every planner that draws
    random numbers, ``checkpoint``/``episodes`` to the agent only (refused elsewhere), ``workers`` and
    ``ray_address`` to the searches that fan out to Ray workers (``heterog.parallel``), ``progress`` to
    planners that show one. A planner gets the options it takes; None means its own default.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise HeterogError(f"unknown planning options {unknown}; known: {list(OPTIONS)}")
    planner = get(method)
    budget_s = options.get("budget_s")
    if budget_s is not None and (budget_s < 0 or (budget_s == 0 and "checkpoint" not in planner.options)):
        raise HeterogError(f"budget must be positive, got {budget_s} s (0 means zero-shot, for the agent "
                           f"with its pretrained checkpoint)")
    refused = [flag for key, flag in OWN_OPTIONS.items() if options.get(key) is not None and key not in planner.options]
    if refused:
        raise HeterogError(f"{' and '.join(refused)} appl{'y' if len(refused) > 1 else 'ies'} to the agent only, "
                           f"not to method {method!r}")
    if evaluator is None:
        from heterog.evaluate import Evaluator

        evaluator = Evaluator(graph, cluster)
    given = {k: v for k, v in options.items() if v is not None and k in planner.options}
    t0 = time.perf_counter()
    strategy = planner.plan(evaluator, **given)
    strategy.method = strategy.method or method         # a pick among planners (best-dp) names the one picked
    strategy.meta.setdefault("search_time_s", time.perf_counter() - t0)
    return strategy


__all__ = ["BEST_DP_CANDIDATES", "ENTRY_POINT_GROUP", "OPTIONS", "Planner", "best_dp", "default_methods", "get",
           "names", "parse_methods", "plan"]

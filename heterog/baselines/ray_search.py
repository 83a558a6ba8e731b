"""MCMC's chains on pool workers (``heterog.parallel``): a worker that keeps an ``ActionSearch`` per
evaluator and runs chain segments, so the generic pool needs nothing of the baselines."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from heterog.baselines.chains import ActionSearch, ChainResult, run_chain
from heterog.parallel import Worker

if TYPE_CHECKING:  # pragma: no cover
    from heterog.parallel import EvaluatorSpec


class SearchWorker(Worker):
    """A pool worker that also runs MCMC chains: ``setup`` builds an ``ActionSearch`` over the key's
    evaluator (with the search's ``oom_factor``, task ``order``, ``splits`` and ``sharded``); ``run_chain`` runs one."""

    def __init__(self) -> None:
        super().__init__()
        self.searches: dict[str, ActionSearch] = {}

    def setup(self, key: str, spec: EvaluatorSpec, oom_factor: float = 10.0, order: str | None = None,
              splits: bool = False, sharded: bool = False) -> None:
        super().setup(key, spec)
        self.searches[key] = ActionSearch(self.evaluators[key], oom_factor, order, splits, sharded)

    def run_chain(self, key: str, job: tuple[Any, ...]) -> ChainResult:
        """``job``: (chain, state or None, segment or None), ``heterog.baselines.chains.run_chain``'s arguments."""
        return run_chain(self.searches[key], *job)

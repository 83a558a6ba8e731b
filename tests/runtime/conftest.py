"""Fixtures of the runtime tests: tiny models captured once, a 3-rank gloo worker pool shared by the
equivalence tests (spawning workers is the slow part), and the emulated clusters."""
from __future__ import annotations

import logging

import pytest

from heterog.cluster import load_cluster
from heterog.runtime import WorkerPool, load_model

BATCH = 6                                       # even shares (2, 2, 2); proportional (3, 2, 1)
HETERO3 = "local-cpu-3:slowdown=1,2,3"

_MODELS: dict = {}


def model(name: str, optimizer: str = "sgd", lr: float = 0.1):
    """A zoo model captured for the runtime (cached across tests)."""
    key = (name, optimizer, lr)
    if key not in _MODELS:
        logging.getLogger("heterog.graph.capture").setLevel(logging.ERROR)
        _MODELS[key] = load_model(name, BATCH, optimizer=optimizer, lr=lr)
    return _MODELS[key]


@pytest.fixture(scope="session")
def hetero3():
    return load_cluster(HETERO3)


@pytest.fixture(scope="session")
def pool3():
    with WorkerPool(3, "gloo", hang_timeout_s=60.0) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool2():
    with WorkerPool(2, "gloo", hang_timeout_s=60.0) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    with WorkerPool(4, "gloo", hang_timeout_s=60.0) as pool:
        yield pool

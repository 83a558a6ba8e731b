"""Fixtures of the env tests: tiny zoo graphs (captured once, cached) on the paper's 8-GPU cluster."""
from __future__ import annotations

import pytest

from heterog.cluster import load_cluster
from heterog.graph.cache import capture_model


@pytest.fixture(scope="session")
def paper8():
    return load_cluster("paper-8gpu")


@pytest.fixture(scope="session")
def tiny_mlp():
    return capture_model("tiny_mlp", 16)


@pytest.fixture(scope="session")
def tiny_cnn():
    return capture_model("tiny_cnn", 16)

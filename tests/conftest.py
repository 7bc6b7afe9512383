"""Shared test fixtures: deterministic seeds, float64 helpers, free ports for gloo."""

import socket

import pytest
import torch

torch.set_num_threads(1)  # the suite runs 2 workers on 2 cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Fixtures of the distributed tests."""

import datetime
import os

import pytest
import torch.distributed as dist

from tests.conftest import free_port


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group for the tests of one module."""
    if dist.is_initialized():
        pytest.skip("a process group is already active in this process")
    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()
    for key, value in saved.items():  # later tests and their subprocesses pick their own port
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

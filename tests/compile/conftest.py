import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_compile_caches():
    """Each test compiles from scratch: code cached by an earlier test (its own hooks, its own
    recompilations) neither helps nor hinders it. Wrappers left by earlier tests are collected
    first: the last one to go removes the engine's global module hook, which must not happen
    while dynamo traces (it guards on that hook)."""
    gc.collect()
    torch.compiler.reset()
    yield
    torch.compiler.reset()

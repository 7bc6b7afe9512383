"""The Philox noise on torch's OpenMP threads (opacus_dp/optim/philox/openmp.py): found where torch
runs on libgomp, the same numbers as one call of the kernel and as the torch reference for any
size, team and divisor (every coordinate drawn once), and off where asked or in a forked child."""

import os

import pytest
import torch

from opacus_dp.optim.philox import draws, openmp
from tests.mechanisms.test_philox_stream import STD, WORDS, native_kernel, run_reference


def team_or_skip():
    native_kernel()
    team = openmp.gomp_parallel()
    if team is None:
        pytest.skip("torch does not run on a libgomp found here")
    return team


@pytest.fixture(autouse=True)
def fresh_lookup():
    openmp.forget()
    yield
    openmp.forget()


def test_torch_libgomp_is_found_where_torch_runs_on_openmp():
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP here")
    path = openmp._torch_libgomp()
    if path is None:
        pytest.skip("no single libgomp mapped")
    assert os.path.basename(path).startswith("libgomp")
    assert openmp.gomp_parallel() is not None


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("n,chunk", [(7 * 256 + 5, 256), (4096, 1024), (100_003, 3 * 256)])
def test_team_draws_every_coordinate_once_as_the_reference(threads, n, chunk):
    team = team_or_skip()
    kernel = native_kernel()
    base = torch.randn(n, generator=torch.Generator().manual_seed(n))
    out = torch.full((n,), float("nan"))
    assert kernel.parallel(team, threads, chunk, out.data_ptr(), None, 0, n, *WORDS, STD, 1.0) >= n  # it ran
    assert torch.equal(out, run_reference(n, 0))
    summed = base.clone()
    kernel.parallel(team, threads, chunk, summed.data_ptr(), summed.data_ptr(), 0, n, *WORDS, STD, 3.0)
    expected = run_reference(n, 0, base=base) / 3.0  # the kernel's division: the same correctly rounded one
    assert torch.equal(summed, expected)


@pytest.mark.parametrize("workers", [2, 4])
def test_fill_on_the_team_equals_fill_on_the_pool(workers, monkeypatch):
    team_or_skip()
    n = 3 * draws.CHUNK_ELEMENTS + 777
    base = torch.randn(n, generator=torch.Generator().manual_seed(1))
    on_team = base.clone()
    draws.fill(on_team, on_team, WORDS, STD, workers)
    monkeypatch.setattr(openmp, "gomp_parallel", lambda: None)
    on_pool = base.clone()
    draws.fill(on_pool, on_pool, WORDS, STD, workers)
    assert torch.equal(on_team, on_pool)
    assert torch.equal(on_team, run_reference(n, 0, base=base))


def test_fill_uses_the_team_when_found(monkeypatch):
    team = team_or_skip()
    kernel = native_kernel()
    calls = []
    monkeypatch.setattr(openmp, "gomp_parallel", lambda: calls.append(team) or team)
    out = torch.zeros(2 * draws.CHUNK_ELEMENTS + 3)
    draws.fill(out, None, WORDS, STD, 2)
    assert calls == [team] and kernel.parallel is not None
    small = torch.zeros(1000)  # one chunk: drawn on the calling thread, no team asked for
    draws.fill(small, None, WORDS, STD, 2)
    assert calls == [team]


def test_a_team_that_runs_nothing_falls_back_to_the_pool_once_and_for_all(monkeypatch):
    """A GOMP_parallel that returns without running the kernel (the counter stays 0) must not leave
    the tensor un-noised: the pool draws it, and the team is not asked again."""
    team_or_skip()
    kernel = native_kernel()

    def run_nothing(*args):
        return 0
    monkeypatch.setattr(kernel, "parallel", run_nothing)
    n = 2 * draws.CHUNK_ELEMENTS + 9
    base = torch.randn(n, generator=torch.Generator().manual_seed(3))
    out = base.clone()
    draws.fill(out, out, WORDS, STD, 2)
    assert torch.equal(out, run_reference(n, 0, base=base))
    assert openmp.gomp_parallel() is None


def test_a_team_that_stops_part_way_is_an_error(monkeypatch):
    team_or_skip()
    kernel = native_kernel()
    monkeypatch.setattr(kernel, "parallel", lambda *args: draws.CHUNK_ELEMENTS)
    with pytest.raises(RuntimeError, match="incomplete"):
        draws.fill(torch.zeros(2 * draws.CHUNK_ELEMENTS + 9), None, WORDS, STD, 2)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("OPACUS_DP_NOISE_OPENMP", "0")
    openmp.forget()
    assert openmp.gomp_parallel() is None


def test_a_forked_child_does_not_use_the_parents_openmp_threads():
    team_or_skip()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it would use, then leave at once
        os.close(read)
        openmp.forget()  # not even a new look-up finds them
        os.write(write, b"none" if openmp.gomp_parallel() is None else b"team")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"none"
    assert openmp.gomp_parallel() is not None  # the parent keeps it

"""Parallel Gaussian noise as a noise mechanism: the protocol, the fused in-place add, snapshot and
restore, checkpoints (a resumed run draws bit for bit what the uninterrupted one draws), per-rank
streams, secure mode keyed only by the operating system, and the opt-in through make_private."""

import io
import math
import os
import signal
import warnings

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.distributed.noise_streams import give_rank_its_stream
from opacus_dp.mechanisms.noise import CorrelatedNoise
from opacus_dp.mechanisms.strategies import make_strategy
from opacus_dp.optim import DPOptimizer, GaussianNoise
from opacus_dp.optim import keyed_generators as keyed
from opacus_dp.optim.chunked_draws import CHUNK_ELEMENTS
from opacus_dp.optim.noise_mechanism import NoiseMechanism
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from tests.engine.helpers import small_loader, small_model

CPU = torch.device("cpu")
SHAPES = [(2 * CHUNK_ELEMENTS + 3,), (4, 5), ()]


def step(noise, shapes=SHAPES, std=1.0):
    noise.begin_step(CPU)
    return [noise.sample(torch.zeros(shape), std) for shape in shapes]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_it_is_a_noise_mechanism_and_a_base_of_correlated_noise():
    assert isinstance(ParallelGaussianNoise(seed=1), NoiseMechanism)
    assert isinstance(ParallelGaussianNoise(secure_mode=True), NoiseMechanism)
    assert ParallelGaussianNoise.shards_alike
    correlated = CorrelatedNoise(make_strategy("independent", steps=3), base=ParallelGaussianNoise(seed=4))
    assert same(step(correlated), step(ParallelGaussianNoise(seed=4)))


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("shape", [(3 * CHUNK_ELEMENTS - 7,), (100,), (2, CHUNK_ELEMENTS)])
def test_fused_add_is_bitwise_sample_plus_total(secure, shape, monkeypatch):
    monkeypatch.setattr("secrets.randbits", lambda bits: 77)
    total = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    make = (lambda: ParallelGaussianNoise(secure_mode=True, num_threads=2)) if secure else \
        (lambda: ParallelGaussianNoise(seed=3, num_threads=2))
    a, b = make(), make()
    a.begin_step(CPU), b.begin_step(CPU)
    expected = a.sample(total, 0.7).add_(total)
    fused = total.clone()
    assert b.add_sample_(fused, 0.7) is fused and torch.equal(fused, expected)
    assert torch.equal(b.add_sample_(fused, 0.0), expected)  # std 0: unchanged


def test_position_advances_only_after_a_step_that_drew():
    noise = ParallelGaussianNoise(seed=2)
    noise.begin_step(CPU)
    noise.begin_step(CPU)  # nothing drawn yet: still step 0
    first = noise.sample(torch.zeros(10), 1.0)
    assert torch.equal(first, step(ParallelGaussianNoise(seed=2), [(10,)])[0])
    assert torch.equal(noise.sample(torch.zeros(()), 0.0), torch.zeros(()))  # std 0 draws nothing
    noise.begin_step(CPU)
    assert noise.state_dict()["parallel_noise"]["step"] == 1


def test_snapshot_and_restore_redraw_the_refused_step():
    noise = ParallelGaussianNoise(seed=9)
    step(noise)
    saved = noise.snapshot()
    refused = step(noise)
    noise.restore(saved)
    assert same(step(noise), refused)
    assert not same(step(noise), refused)


def test_checkpoint_round_trip_resumes_bit_for_bit():
    uninterrupted = ParallelGaussianNoise(seed=21)
    expected = [step(uninterrupted) for _ in range(5)]
    first = ParallelGaussianNoise(seed=21)
    drawn = [step(first) for _ in range(3)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = ParallelGaussianNoise(seed=1234)  # another process: another key until loaded
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    drawn += [step(resumed) for _ in range(2)]
    assert all(same(a, b) for a, b in zip(drawn, expected))


def test_states_of_another_stream_are_refused_or_warned():
    noise = ParallelGaussianNoise(seed=1)
    with pytest.raises(ValueError, match="fast_noise=False"):
        noise.load_state_dict(GaussianNoise(torch.Generator().manual_seed(0)).state_dict())
    state = noise.state_dict()
    state["parallel_noise"]["chunk_elements"] = 4096
    with pytest.raises(ValueError, match="chunks"):
        noise.load_state_dict(state)
    before = noise.state_dict()
    with pytest.warns(UserWarning, match="secure mode"):
        noise.load_state_dict(ParallelGaussianNoise(secure_mode=True).state_dict())
    assert noise.state_dict() == before


def test_rank_streams_are_reproducible_and_distinct():
    def rank_draws(rank):
        noise = ParallelGaussianNoise(seed=5)
        give_rank_its_stream(noise, rank)
        return step(noise)

    assert same(rank_draws(1), rank_draws(1))
    assert not any(torch.equal(a, b) for a, b in zip(rank_draws(0), rank_draws(1)))
    with pytest.raises(ValueError, match="seed must be an int"):
        ParallelGaussianNoise(seed=1).reseed(2**64)


def test_key_from_a_generator_or_the_global_rng_is_reproducible_and_leaves_them_untouched():
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert same(step(ParallelGaussianNoise(generator)), step(ParallelGaussianNoise(torch.Generator().manual_seed(3))))
    assert torch.equal(generator.get_state(), state)
    torch.manual_seed(0)
    a = step(ParallelGaussianNoise())
    torch.manual_seed(0)
    assert same(a, step(ParallelGaussianNoise()))


def test_secure_noise_is_keyed_by_the_os_at_every_step_and_never_by_the_user(monkeypatch):
    for unsafe in (dict(seed=1), dict(generator=torch.Generator())):
        with pytest.raises(ValueError, match="secure_mode"):
            ParallelGaussianNoise(secure_mode=True, **unsafe)
    secure = ParallelGaussianNoise(secure_mode=True)
    for refused in (lambda: secure.reseed(1), secure.stream_base):
        with pytest.raises(ValueError, match="secure"):
            refused()
    give_rank_its_stream(secure, 1)  # FSDP2 leaves a secure stream alone
    torch.manual_seed(0)
    a = step(ParallelGaussianNoise(secure_mode=True))
    torch.manual_seed(0)
    assert not any(torch.equal(x, y) for x, y in zip(a, step(ParallelGaussianNoise(secure_mode=True))))
    secure.load_state_dict(ParallelGaussianNoise(seed=1).state_dict())  # a saved key is not taken
    assert secure.state_dict() == {"secure_mode": True, "parallel_noise": {}}
    assert not any(torch.equal(x, y) for x, y in zip(step(secure), step(ParallelGaussianNoise(seed=1))))
    requested = []
    monkeypatch.setattr("secrets.randbits", lambda bits: requested.append(bits) or 11 + len(requested))
    fresh = ParallelGaussianNoise(secure_mode=True)
    first, second = step(fresh, [(6,)]), step(fresh, [(6,)])
    assert requested == [128, 128]  # one 128-bit OS key per step ...
    for t, (drawn, key) in enumerate([(first, 12), (second, 13)]):  # ... and nothing else keys the draws
        generator = keyed.cpu_generator(key, t, 0, 2**64 - 1)
        z = [torch.normal(0.0, 1.0, size=(6,), generator=generator) for _ in range(4)]
        assert torch.equal(drawn[0], (z[0] + z[1] + z[2] + z[3]) / 2)
    saved = fresh.snapshot()
    assert saved[0] is None  # a snapshot holds no key
    fresh.restore(saved)
    fresh.sample(torch.zeros(3), 1.0)  # a draw after a restore takes a new OS key
    assert requested == [128, 128, 128]


def test_zero_gradient_update_has_noise_std_sigma_c_over_b():
    sigma, bound, batch = 1.3, 0.7, 8
    weight = nn.Parameter(torch.zeros(1024, 520))
    opt = DPOptimizer(torch.optim.SGD([weight], lr=1.0), noise_multiplier=sigma, max_grad_norm=bound,
                      expected_batch_size=batch, noise=ParallelGaussianNoise(seed=3, num_threads=2))
    weight.grad_sample = torch.zeros(batch, 1024, 520)
    opt.step()
    expected, n = sigma * bound / batch, weight.numel()
    assert abs(float(weight.grad.double().std()) / expected - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(weight.grad.double().mean())) < 5 * expected / math.sqrt(n)


def _private(model, fast_noise):
    engine = PrivacyEngine(accountant="rdp")
    gsm, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           data_loader=small_loader(n=16, batch_size=4), noise_multiplier=0.8,
                                           max_grad_norm=0.5, fast_noise=fast_noise)
    return engine, gsm, opt, loader


def _run(fast_noise, path=None):
    """Two epochs; with ``path``, interrupted after the first and resumed in a new engine."""
    torch.manual_seed(7)
    model = small_model()
    engine, gsm, opt, loader = _private(model, fast_noise)
    for epoch in range(2):
        if path is not None and epoch == 1:
            engine.save_checkpoint(path=path, module=gsm, optimizer=opt)
            torch.manual_seed(999)  # another process: other initial weights, other global RNG
            model = small_model(seed=123)
            engine, gsm, opt, loader = _private(model, fast_noise)
            engine.load_checkpoint(path=path, module=gsm, optimizer=opt)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(gsm(x), y).backward()
            opt.step()
    return opt, [p.detach().clone() for p in model.parameters()]


def test_make_private_opt_in_and_resume(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default_opt, default_params = _run(False)
        fast_opt, fast_params = _run(True)
        _, resumed_params = _run(True, tmp_path / "c.pt")
    assert type(default_opt.noise) is GaussianNoise and type(fast_opt.noise) is ParallelGaussianNoise
    assert not all(torch.equal(a, b) for a, b in zip(default_params, fast_params))  # another stream
    assert all(torch.equal(a, b) for a, b in zip(fast_params, resumed_params))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_with_threads_of_its_own():
    """The parent's pool threads do not exist in a forked child (it would wait on them forever)."""
    parent = ParallelGaussianNoise(seed=6, num_threads=2)
    expected = step(parent, [(4 * CHUNK_ELEMENTS,)])[0]
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 if it draws the parent's noise within the alarm
        torch.set_num_threads(1)  # torch's own OpenMP threads are not fork-safe either
        signal.alarm(30)
        drawn = step(ParallelGaussianNoise(seed=6, num_threads=2), [(4 * CHUNK_ELEMENTS,)])[0]
        os._exit(0 if torch.equal(drawn, expected) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status

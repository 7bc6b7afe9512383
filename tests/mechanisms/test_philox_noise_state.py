"""Philox Gaussian noise as a noise mechanism: draws are the stream of their position, the fused
add and noised are bitwise sample + total, dtypes and layouts, checkpoints, refusals of other
noises' states, snapshot and restore, secure mode keyed only by the OS, and make_private."""

import io
import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.optim import GaussianNoise
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise, key_of_generator
from opacus_dp.optim.philox import reference
from opacus_dp.optim.philox.draws import stream_words
from opacus_dp.optim.philox_noise import STREAM, PhiloxGaussianNoise
from tests.engine.helpers import small_loader

CPU = torch.device("cpu")
SHAPES = [(3000,), (4, 5), (), (2, 300)]


def step(noise, shapes=SHAPES, std=1.0):
    noise.begin_step(CPU)
    return [noise.sample(torch.zeros(shape), std) for shape in shapes]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def oracle(key, step_index, slot, shape, std, draws=1):
    """The stream of the position by the torch reference: Σ_d float32(std/√draws)·z_d."""
    n, scale = math.prod(shape), float(np.float32(std / math.sqrt(draws)))
    out = torch.empty(n)
    for d in range(draws):
        reference.fill(out, out if d else None, 0, stream_words(key, step_index, slot, d), scale)
    return out.view(shape)


def test_draws_are_the_stream_of_their_position_and_reproducible():
    key, std = 0xFEEDFACE12345678, 0.8
    noise = PhiloxGaussianNoise(seed=key, num_threads=2)
    steps = [step(noise, std=std) for _ in range(3)]
    for t, drawn in enumerate(steps):
        for slot, (shape, x) in enumerate(zip(SHAPES, drawn)):
            assert x.dtype == torch.float32 and torch.equal(x, oracle(key, t, slot, shape, std)), (t, slot)
    again = PhiloxGaussianNoise(seed=key, num_threads=1)
    assert all(same(a, step(again, std=std)) for a in steps)
    other = step(PhiloxGaussianNoise(seed=key + 1), std=std)
    assert not any(torch.equal(a, b) for a, b in zip(steps[0], other))


def test_generator_derives_the_key_without_advancing_it():
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    drawn = step(PhiloxGaussianNoise(generator))
    assert torch.equal(generator.get_state(), state)
    assert same(drawn, step(PhiloxGaussianNoise(torch.Generator().manual_seed(3))))
    assert same(drawn, step(PhiloxGaussianNoise(seed=key_of_generator(generator))))
    other = step(PhiloxGaussianNoise(torch.Generator().manual_seed(4)))
    assert not any(torch.equal(a, b) for a, b in zip(drawn, other))
    torch.manual_seed(0)
    first = step(PhiloxGaussianNoise())
    torch.manual_seed(0)
    assert same(first, step(PhiloxGaussianNoise()))


def totals():
    g = torch.Generator().manual_seed(0)
    yield "float32 large", torch.randn(2 * 2 ** 18 + 5, generator=g)
    for dtype in (torch.float32, torch.bfloat16):  # float64: test_float64_tensors_get_float64_draws
        yield f"{dtype}", torch.randn(30, 70, generator=g).to(dtype)
        yield f"{dtype} transposed", torch.randn(600, 7, generator=g).to(dtype).t()


@pytest.mark.parametrize("name, total", list(totals()), ids=[name for name, _ in totals()])
def test_sample_noised_and_add_sample_agree_bitwise(name, total):
    std, key = 1.3, 4242
    a, b, c = (PhiloxGaussianNoise(seed=key, num_threads=2) for _ in range(3))
    for noise in (a, b, c):
        noise.begin_step(CPU)
    before = total.clone()
    sample = a.sample(total, std)
    assert sample.shape == total.shape and sample.dtype == total.dtype
    assert torch.equal(sample, oracle(key, 0, 0, tuple(total.shape), std).to(total.dtype))
    expected = sample + total
    noised = b.noised(total, std)
    assert noised.dtype == total.dtype and torch.equal(noised, expected) and torch.equal(total, before)
    fused = total.clone()
    assert c.add_sample_(fused, std) is fused and torch.equal(fused, expected)
    assert fused.stride() == total.stride()


@pytest.mark.parametrize("shape, transposed", [((30, 70), False), ((600, 7), True), ((3 * 2 ** 17 + 5,), False)])
def test_float64_tensors_get_float64_draws(shape, transposed):
    """float32 draws added to a float64 sum would leave ``noised - total`` a float32 number for the
    true sum only (its low-order bits exposed): a float64 tensor gets ParallelGaussianNoise's
    float64 draws at the same position, through every path alike."""
    std, key = 1.3, 4242
    total = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    total = total.t() if transposed else total
    philox = [PhiloxGaussianNoise(seed=key, num_threads=2) for _ in range(3)]
    threads = ParallelGaussianNoise(seed=key, num_threads=2)
    for noise in philox + [threads]:
        noise.begin_step(CPU)
    sample = philox[0].sample(total, std)
    assert sample.dtype == torch.float64 and torch.equal(sample, threads.sample(total, std))
    assert torch.equal(philox[1].noised(total, std), sample + total)
    fused = total.clone()
    assert torch.equal(philox[2].add_sample_(fused, std), sample + total)
    released = sample + total
    on_float32_lattice = (released - total).float().double() == (released - total)
    assert float(on_float32_lattice.double().mean()) < 0.01


def test_zero_std_draws_nothing():
    noise = PhiloxGaussianNoise(seed=8)
    noise.begin_step(CPU)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        total = torch.randn(5, 300).to(dtype)
        zeros = noise.sample(total, 0.0)
        assert zeros.dtype == dtype and torch.equal(zeros, torch.zeros_like(total))
        kept = total.clone()
        assert noise.add_sample_(kept, 0.0) is kept and torch.equal(kept, total)
        assert torch.equal(noise.noised(total, 0.0), total)
    assert torch.equal(noise.sample(torch.zeros(40), 1.0), oracle(8, 0, 0, (40,), 1.0))  # still slot 0


def test_checkpoint_round_trip_resumes_bit_for_bit():
    uninterrupted = PhiloxGaussianNoise(seed=21)
    expected = [step(uninterrupted) for _ in range(5)]
    first = PhiloxGaussianNoise(seed=21)
    drawn = [step(first) for _ in range(3)]
    first.begin_step(CPU)
    drawn_half = [first.sample(torch.zeros(shape), 1.0) for shape in SHAPES[:2]]  # saved mid-step
    state = first.state_dict()
    assert state == {"secure_mode": False, "philox_noise": {"key": 21, "step": 3, "slot": 2, "stream": STREAM}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = PhiloxGaussianNoise(seed=1234)  # another process: another key until loaded
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    drawn.append(drawn_half + [resumed.sample(torch.zeros(shape), 1.0) for shape in SHAPES[2:]])
    drawn.append(step(resumed))
    assert all(same(a, b) for a, b in zip(drawn, expected))


def equal_states(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal_states(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def refused(target, state, message):
    before = target.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        target.load_state_dict(state)
    assert equal_states(target.state_dict(), before)


def test_states_of_other_noises_are_refused_naming_their_setting():
    philox = PhiloxGaussianNoise(seed=1)
    step(philox)
    refused(philox, ParallelGaussianNoise(seed=1).state_dict(), "fast_noise=True")
    refused(philox, GaussianNoise(torch.Generator().manual_seed(0)).state_dict(), "fast_noise=False")
    refused(ParallelGaussianNoise(seed=1), philox.state_dict(), "fast_noise='philox'")
    refused(GaussianNoise(torch.Generator().manual_seed(0)), philox.state_dict(), "fast_noise='philox'")
    state = philox.state_dict()
    state["philox_noise"]["stream"] = "philox4x32-10 box-muller v0"
    refused(philox, state, "box-muller v0")
    before = philox.state_dict()
    with pytest.warns(UserWarning, match="secure mode"):
        philox.load_state_dict(PhiloxGaussianNoise(secure_mode=True).state_dict())
    assert philox.state_dict() == before


def test_snapshot_and_restore_redraw_the_refused_step():
    noise = PhiloxGaussianNoise(seed=9)
    step(noise)
    saved = noise.snapshot()
    refused_step = step(noise)
    noise.restore(saved)
    assert same(step(noise), refused_step)
    following = step(noise)
    assert not any(torch.equal(a, b) for a, b in zip(following, refused_step))
    assert same(following, [oracle(9, 2, slot, shape, 1.0) for slot, shape in enumerate(SHAPES)])


def test_secure_mode_refuses_user_seeds():
    for unsafe in (dict(seed=1), dict(generator=torch.Generator().manual_seed(1))):
        with pytest.raises(ValueError, match="secure_mode"):
            PhiloxGaussianNoise(secure_mode=True, **unsafe)
    secure = PhiloxGaussianNoise(secure_mode=True)
    for call in (secure.stream_base, lambda: secure.reseed(1)):
        with pytest.raises(ValueError, match="secure"):
            call()
    secure.load_state_dict(PhiloxGaussianNoise(seed=1).state_dict())  # a saved key is not taken
    assert secure.state_dict() == {"secure_mode": True, "philox_noise": {}}
    assert not any(torch.equal(a, b) for a, b in zip(step(secure), step(PhiloxGaussianNoise(seed=1))))


def test_secure_noise_ignores_the_global_seed():
    torch.manual_seed(0)
    a = step(PhiloxGaussianNoise(secure_mode=True))
    torch.manual_seed(0)
    b = step(PhiloxGaussianNoise(secure_mode=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, b))


def test_secure_noise_is_keyed_by_the_os_at_every_step(monkeypatch):
    requested = []
    monkeypatch.setattr("opacus_dp.optim.parallel_noise.secrets.randbits",
                        lambda bits: requested.append(bits) or 1000 + len(requested))
    std, runs = 1.5, []
    for global_seed in (0, 1):  # the global RNG plays no part: same OS keys, same draws
        requested.clear()
        torch.manual_seed(global_seed)
        noise = PhiloxGaussianNoise(secure_mode=True, num_threads=2)
        runs.append([step(noise, std=std) for _ in range(3)])
        assert requested == [128, 128, 128]  # one 128-bit OS key per begin_step
    assert all(same(a, b) for a, b in zip(*runs))
    for t, drawn in enumerate(runs[0]):
        for slot, (shape, x) in enumerate(zip(SHAPES, drawn)):
            assert torch.equal(x, oracle(1001 + t, t, slot, shape, std, draws=4)), (t, slot)
    saved = noise.snapshot()
    assert saved[0] is None  # a snapshot holds no key
    noise.restore(saved)
    noise.sample(torch.zeros(3), 1.0)  # a draw after a restore takes a new OS key
    assert requested == [128] * 4


def train(fast_noise, sigma, dtype=torch.float32):
    torch.manual_seed(7)
    model = nn.Linear(4, 2).to(dtype)
    initial = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        gsm, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=small_loader(n=8, batch_size=4, dtype=dtype), noise_multiplier=sigma, max_grad_norm=0.5,
            fast_noise=fast_noise)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(gsm(x), y).backward()
            opt.step()
    return opt, initial, [p.detach().clone() for p in model.parameters()]


def test_make_private_with_philox_noise():
    opt, initial, philox = train("philox", 1.0)
    assert type(opt.noise) is PhiloxGaussianNoise
    assert same(philox, train("philox", 1.0)[2])  # reproducible under torch.manual_seed
    assert not any(torch.equal(a, b) for a, b in zip(philox, initial))
    for other in (False, True):
        assert not any(torch.equal(a, b) for a, b in zip(philox, train(other, 1.0)[2])), other
    noiseless = [train(fast_noise, 0.0) for fast_noise in (False, True, "philox")]
    assert not any(torch.equal(a, b) for a, b in zip(noiseless[0][2], noiseless[0][1]))  # it trained
    assert same(noiseless[0][2], noiseless[1][2]) and same(noiseless[0][2], noiseless[2][2])


def test_a_float64_model_with_philox_gets_the_parallel_float64_draws():
    """The stream draws float32; a float64 model's noise is ParallelGaussianNoise's (``True``) at
    the same positions and key (philox_noise.py), not float32 draws widened."""
    philox, threads = train("philox", 1.0, torch.float64)[2], train(True, 1.0, torch.float64)[2]
    assert same(philox, threads) and not same(philox, train(False, 1.0, torch.float64)[2])


@pytest.mark.parametrize("fast_noise", ["bogus", 1, "Philox"])
def test_make_private_refuses_other_fast_noise_values(fast_noise):
    with pytest.raises(ValueError, match="fast_noise"):
        train(fast_noise, 1.0)

"""The mean's division applied by the Philox noise in its own pass.

Where nothing but the division follows the noise (one process, or FSDP2's own shards), the step's
Philox noise writes ``(S + N) / B`` in one pass. Oracles: the same noise added, then ``div_`` (bit for
bit: the kernel's division is the same correctly rounded float32 division), and the torch reference
of the stream. Where something follows the noise (DDP's all-reduce) or a subclass replaces
``add_noise``/``scale_grad``, the division stays a pass of its own.
"""

import pytest
import torch

from opacus_dp.optim import DPOptimizer, LocalReducer
from opacus_dp.optim.noise import noise_std
from opacus_dp.optim.philox import draws, native, reference
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from tests.mechanisms.test_philox_stream import run_kernel

WORDS = (11, 22, 33, 44)
DIVISORS = [1.0, 3.0, 7.3, 96.0, 1e-3]
POSITION = (12345, 3, 1)


@pytest.mark.parametrize("divisor", DIVISORS)
@pytest.mark.parametrize("with_base", ["none", "base", "aliased"])
def test_the_kernel_divides_as_a_division_after_it(divisor, with_base):
    kernel = native.kernel()
    if kernel is None:
        pytest.skip(f"native Philox kernel unavailable: {native.unavailable_reason()}")
    n, start = 1000, 512
    base = None if with_base == "none" else torch.randn(n, generator=torch.Generator().manual_seed(1))
    alias = with_base == "aliased"
    got = run_kernel(kernel, n, start, WORDS, 0.7, base, alias=alias, divisor=divisor)
    plain = run_kernel(kernel, n, start, WORDS, 0.7, base, alias=alias)
    assert torch.equal(got, plain / divisor)
    expected = torch.empty(n)
    reference.fill(expected, base, start, WORDS, 0.7, divisor)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("secure_draws", [1, 4])
@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noised_and_divided_is_noised_then_divided(secure_draws, reuse, dtype):
    total = torch.randn(700_000, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = draws.noised(total.clone(), 0.3, POSITION, secure_draws, workers=2).div_(7.3)
    given = total.clone()
    got = draws.noised(given, 0.3, POSITION, secure_draws, workers=2, reuse=reuse, divisor=7.3)
    assert torch.equal(got, expected)
    assert (got is given) == reuse
    if not reuse:
        assert torch.equal(given, total)  # the sum itself is left as it was


def test_the_stream_refuses_a_float64_tensor():
    """Its float32 draws on a float64 sum would leave the sum's low-order bits in the result
    (the mechanism gives float64 tensors float64 draws instead: test_philox_noise_state.py)."""
    total = torch.randn(1000, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        draws.noised(total, 0.3, POSITION, 1, workers=1)
    with pytest.raises(TypeError, match="float64"):
        draws.draw(total, 0.3, POSITION, 1, add=True, workers=1)


def test_the_mechanism_divides_as_noised_then_div():
    total = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    fused, separate = PhiloxGaussianNoise(seed=9), PhiloxGaussianNoise(seed=9)
    for noise in (fused, separate):
        noise.begin_step(torch.device("cpu"))
    assert torch.equal(fused.noised_divided(total, 0.5, False, 4.0), separate.noised(total, 0.5).div_(4.0))
    assert torch.equal(fused.noised_divided(total, 0.0, False, 4.0), total / 4.0)  # σ = 0: the division only


class SeparateScaling(DPOptimizer):
    """The same step with ``scale_grad`` replaced by a subclass: the division stays its own pass."""

    def scale_grad(self, sums):
        return super().scale_grad(sums)


class AddsAfterTheNoise(LocalReducer):
    """A reducer that adds to the noised tensors (as an all-reduce adds the other ranks' sums)."""

    world_size = 2

    def reduce(self, release):
        return [t + 1.0 for t in release.bucket(noised=True)]


def _step(optimizer_class=DPOptimizer, reducer=None, loss_reduction="mean"):
    """One step on fixed per-sample gradients of one tensor: ``(p.grad, oracle of S + N)`` with the
    clipped sum ``S`` by hand and ``N`` the first draw of a fresh noise of the same seed."""
    weight = torch.nn.Parameter(torch.zeros(64, 33))
    per_sample = torch.randn(6, 64, 33, generator=torch.Generator().manual_seed(4))
    weight.grad_sample = per_sample
    optimizer = optimizer_class(torch.optim.SGD([weight], lr=0.1), noise_multiplier=1.3, max_grad_norm=2.0,
                                expected_batch_size=6, loss_reduction=loss_reduction,
                                noise=PhiloxGaussianNoise(seed=21), reducer=reducer)
    optimizer.pre_step()
    norms = per_sample.flatten(1).norm(dim=1)
    clipped = (per_sample * (2.0 / (norms + 1e-6)).clamp(max=1.0).view(-1, 1, 1)).sum(0)
    oracle_noise = PhiloxGaussianNoise(seed=21)
    oracle_noise.begin_step(torch.device("cpu"))
    return weight.grad, clipped + oracle_noise.sample(clipped, noise_std(1.3, optimizer.clipper))


def test_the_step_divides_in_the_noise_as_it_would_after_it(monkeypatch):
    divisors = []
    original = PhiloxGaussianNoise.noised_divided
    monkeypatch.setattr(PhiloxGaussianNoise, "noised_divided",
                        lambda self, *args: divisors.append(args[-1]) or original(self, *args))
    fused, noised = _step()
    assert divisors == [6.0]  # the noise divided, by the expected batch size
    separate, _ = _step(SeparateScaling)
    assert divisors == [6.0] and torch.equal(fused, separate)
    torch.testing.assert_close(fused, noised / 6, rtol=1e-5, atol=1e-6)


def test_no_division_in_the_noise_where_the_reducer_adds_after_it_or_for_sums():
    after, noised = _step(reducer=AddsAfterTheNoise())
    assert torch.equal(after, _step(SeparateScaling, reducer=AddsAfterTheNoise())[0])
    torch.testing.assert_close(after, (noised + 1.0) / 12, rtol=1e-5, atol=1e-6)  # not N/12 + 1
    summed, noised = _step(loss_reduction="sum")
    torch.testing.assert_close(summed, noised, rtol=1e-5, atol=1e-5)  # a sum is not divided

"""``weighted_sum``: ``Σ_i f_i g_i`` of per-sample gradients of any layout, against a float64 oracle,
in float32 for half-precision gradients, and bit for bit the numbers of
``torch.einsum("i,i...->...")`` (the product it forms, without the equation's parsing)."""

import pytest
import torch

from opacus_dp.maths.per_sample import weighted_sum


def _layouts(batch: int, dtype: torch.dtype, gen: torch.Generator):
    """Per-sample gradients ``(B, ...)``: contiguous, transposed, strided, 1-D and 3-D."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return {
        "contiguous": randn(batch, 37),
        "transposed": randn(37, batch).t(),
        "strided": randn(batch, 74)[:, ::2],
        "one value each": randn(batch),
        "3-d, inner transposed": randn(batch, 5, 7).transpose(1, 2),
        "large": randn(batch, 4099),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_weighted_sum_matches_a_float64_oracle_for_every_layout(dtype, batch):
    gen = torch.Generator().manual_seed(batch)
    factors = torch.rand(batch, generator=gen, dtype=torch.float64) + 0.1
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name, grads in _layouts(batch, dtype, gen).items():
        got = weighted_sum(factors.to(expected_dtype), grads)
        want = (factors.view(-1, *[1] * (grads.dim() - 1)) * grads.double()).sum(dim=0)
        assert got.dtype == expected_dtype and got.shape == grads.shape[1:], name
        tolerance = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_sum_gives_einsums_numbers_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(7)
    for batch in (1, 3, 7, 32, 129):
        factors = torch.rand(batch, generator=gen, dtype=dtype)
        layouts = _layouts(batch, dtype, gen)
        for width in (1, 8):  # narrow transposed gradients: where a plain matrix product sums otherwise
            layouts[f"transposed, {width} wide"] = torch.randn(width, batch, generator=gen, dtype=dtype).t()
        for name, grads in layouts.items():
            assert torch.equal(weighted_sum(factors, grads), torch.einsum("i,i...->...", factors, grads)), name


def test_an_empty_batch_sums_to_zeros_of_the_parameters_shape():
    got = weighted_sum(torch.zeros(0), torch.zeros(0, 3, 4))
    assert got.shape == (3, 4) and not got.any()
    assert weighted_sum(torch.zeros(0), torch.zeros(0)).shape == ()

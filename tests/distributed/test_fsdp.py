"""DP-SGD on a model sharded with FSDP2 (``fully_shard``), 2 gloo processes on CPU, different data
on every rank, clipping active.

One spawned job runs every case (``workers_fsdp.fsdp_job``); the tests compare what the ranks
reported with independent references computed here: one process replaying the concatenated
batches with per-sample gradients from a batch-size-1 autograd loop, clipped by hand (σ = 0);
the Gaussian distribution N(0, (σC/B)²) of the noise (σ > 0); and a one-process accountant.
"""

import math

import pytest
import torch
import torch.nn as nn

from opacus_dp.accountants import RDPAccountant
from tests.distributed.oracle import replay_on_one_process
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers_fsdp import DELTA, FLAT_C, LAYER_C, LR, fsdp_job, make_model

pytestmark = pytest.mark.distributed
WORLD = 2
MODES = ("bk", "ghost", "hooks", "functorch")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's report of the one spawned job."""
    return run_on_ranks(fsdp_job, WORLD, str(tmp_path_factory.mktemp("fsdp_ckpt")), timeout=900)


def replay(reports, clip):
    """σ = 0 reference: one process, the ranks' batches of each step concatenated, SGD."""
    return replay_on_one_process(make_model(seed=0), reports, clip, LR)


def assert_params_equal(reports, expected, rtol=1e-6, atol=1e-7):
    for report in reports:
        for got, want in zip(report["final"], expected):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def some_sample_clipped(reports, clip) -> bool:
    """The data must exercise clipping: a per-sample gradient norm above the flat bound."""
    model = make_model(seed=0)
    x, y = reports[0]["batches"][0][0]
    norms = [math.sqrt(sum(float(g.pow(2).sum()) for g in torch.autograd.grad(
        nn.CrossEntropyLoss()(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters())))) for i in range(len(x))]
    return max(norms) > clip


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", MODES)
def test_sigma_zero_equals_one_process_on_the_concatenated_batch(ranks, mode, clipping):
    reports = [r[("sigma0", mode, clipping)] for r in ranks]
    assert reports[0]["steps"] == 3 and sum(len(p) for p in reports[0]["batches"]) > 3  # virtual steps ran
    clip = FLAT_C if clipping == "flat" else [LAYER_C] * len(reports[0]["start"])
    assert some_sample_clipped(reports, FLAT_C)
    assert_params_equal(reports, replay(reports, clip))
    assert not torch.equal(reports[0]["final"][0], reports[0]["start"][0])


def test_hooks_runs_as_bk_without_per_sample_copies_of_the_unsharded_layers(ranks):
    """Opacus's default mode under FSDP2: the norms-only wrapper, no ``p.grad_sample`` (the update is
    the oracle's: test above); ``functorch`` still keeps them, at the layers' full shapes."""
    shapes = [tuple(p.shape) for p in make_model(seed=0).parameters()]
    for report in (r[("per_sample_state", "hooks")] for r in ranks):
        assert report["wrapper"] == "BookkeepingGradSampleModule"
        assert report["kept"] == [None] * len(shapes)
    for report in (r[("per_sample_state", "functorch")] for r in ranks):
        assert report["wrapper"] == "GradSampleModule"
        assert report["kept"] == [(report["rows"], *shape) for shape in shapes]


def test_hooks_with_autograd_weight_gradients_trains_as_the_oracle(ranks):
    """``skip_weight_grads=False``: FSDP2 reduce-scatters autograd's gradients as well; the step's
    private gradient replaces them."""
    reports = [r[("sigma0", "hooks", "flat", "weight_grads")] for r in ranks]
    assert_params_equal(reports, replay(reports, FLAT_C))
    assert reports[0]["grad_types"] == ["DTensor"]


def test_a_model_the_user_sharded_trains_as_the_flag_shards_it(ranks):
    by_hand = [r[("sigma0", "bk", "flat", "hand")] for r in ranks]
    assert_params_equal(by_hand, replay(by_hand, FLAT_C))
    assert by_hand[0]["grad_types"] == ["DTensor"]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_model_sharded_down_to_its_layers_trains_as_the_oracle(ranks, mode):
    """Every ``Linear`` and ``LayerNorm`` passed to ``fully_shard`` itself (their formulas apply to
    FSDP2's ``FSDPLinear``/``FSDPLayerNorm``: tests/distributed/test_fsdp_sharded_leaves.py)."""
    leaves = [r[("sigma0", mode, "flat", "leaves")] for r in ranks]
    assert_params_equal(leaves, replay(leaves, FLAT_C))
    assert leaves[0]["grad_types"] == ["DTensor"]
    assert leaves[0]["reduce_scatters"] > ranks[0][("sigma0", "bk", "flat", "hand")]["reduce_scatters"]


def test_one_reduce_scatter_per_fully_shard_module_per_step(ranks):
    report = ranks[0][("sigma0", "bk", "flat")]
    modules = 3  # two blocks and the root
    assert report["reduce_scatters"] == modules * report["steps"]
    model = make_model(seed=0)
    padded = sum(math.ceil(p.shape[0] / WORLD) * WORLD * (p.numel() // p.shape[0]) for p in model.parameters())
    assert report["bytes"] == 4 * padded * report["steps"]  # float32 sums, never a second gradient


def _noise_matrix(reports):
    """``(steps, coordinates of both ranks)``: every rank's shards of each step's gradient."""
    return torch.stack([torch.cat([torch.cat(r["draws"][s]) for r in reports])
                        for s in range(len(reports[0]["draws"]))])


NOISE_CASES = ["noise", "noise_secure", "noise_philox", "noise_philox_secure", "noise_threads"]


@pytest.mark.parametrize("case", NOISE_CASES)
def test_noise_std_is_sigma_c_over_the_global_batch(ranks, case):
    reports = [r[case] for r in ranks]
    noise = _noise_matrix(reports) * reports[0]["global_batch"]
    expected = reports[0]["std"]
    n = noise.numel()
    assert n > 100_000  # the std's relative standard error is 1/sqrt(2n) < 0.3 %
    assert abs(float(noise.std()) / expected - 1) < 0.03
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(n)


@pytest.mark.parametrize("case", NOISE_CASES)
def test_ranks_add_uncorrelated_noise_even_when_seeded_alike(ranks, case):
    """Both ranks seeded torch and the noise generator with the same seeds: their shards' noise
    must still be independent (identical streams would add the same draws to other coordinates)."""
    reports = [r[case] for r in ranks]
    for step in range(len(reports[0]["draws"])):
        first, second = (torch.cat(r["draws"][step]) for r in reports)
        n = min(first.numel(), second.numel())
        correlation = torch.corrcoef(torch.stack([first[:n], second[:n]]))[0, 1]
        assert abs(float(correlation)) < 5 / math.sqrt(n)
    steps = _noise_matrix(reports)
    correlation = torch.corrcoef(steps)  # steps are independent too
    off_diagonal = correlation[~torch.eye(len(steps), dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < 5 / math.sqrt(steps.shape[1])


@pytest.mark.parametrize("case", [("sigma0", "bk", "flat"), "noise"])
def test_epsilon_identical_on_ranks_and_equal_to_one_process(ranks, case):
    reports = [r[case] for r in ranks]
    assert reports[0]["epsilon"] == reports[1]["epsilon"]
    if case == "noise":
        reference = RDPAccountant()
        for _ in range(reports[0]["steps"]):
            reference.step(noise_multiplier=reports[0]["sigma"], sample_rate=reports[0]["sample_rate"])
        assert reports[0]["sample_rate"] == pytest.approx(1 / 8)  # the global rate, not 1/(8·W)
        assert reports[0]["epsilon"] == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    else:
        assert math.isinf(reports[0]["epsilon"])  # σ = 0 is not private


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_resumed_run_equals_an_uninterrupted_one(ranks, mode):
    for r in ranks:
        whole, second = r[("resume", mode, "whole")], r[("resume", mode, "second")]
        for a, b in zip(whole["final"], second["final"]):
            assert torch.equal(a, b)
        assert whole["epsilon"] == second["epsilon"] and second["steps"] == 4
    files = ranks[0][("resume", mode, "first")]["files"]
    assert files == ["private_rank0.pt", "private_rank1.pt", "sharded"]


def test_bf16_mixed_precision_keeps_float32_sums(ranks):
    reports = [r["bf16"] for r in ranks]
    assert reports[0]["grad_dtypes"] == ["torch.float32"]
    expected = replay(reports, FLAT_C)
    assert_params_equal(reports, expected, rtol=0, atol=3e-2)  # bf16 forward/backward
    moved = sum(float((got - start).abs().sum()) for got, start in zip(reports[0]["final"], reports[0]["start"]))
    assert moved > 0.1


def test_an_empty_local_batch_takes_part_in_the_step(ranks):
    reports = [r["empty"] for r in ranks]
    assert [len(b[0][0]) for b in reports[1]["batches"]] == [3, 0, 3]
    assert reports[0]["steps"] == reports[1]["steps"] == 3
    assert_params_equal(reports, replay(reports, FLAT_C))


@pytest.mark.parametrize("case", ["classic", "classic_flag"])
def test_classic_attach_on_a_sharded_model(ranks, case):
    reports = [r[case] for r in ranks]
    assert reports[0]["sample_rate"] == pytest.approx(4 * WORLD / 64)
    assert_params_equal(reports, replay(reports, FLAT_C))


@pytest.mark.parametrize("case,words", [
    ("adaptive", "adaptive"), ("twice", "already sharded"), ("root_not_sharded", "root module"),
    ("stepped_optimizer", "has not stepped"), ("unknown_option", "not supported")])
def test_what_cannot_be_sharded_privately_is_refused_on_every_rank(ranks, case, words):
    messages = [r["refusals"][case] for r in ranks]
    assert all(words in m for m in messages), messages


def test_a_setting_that_differs_between_ranks_refuses_the_step_everywhere(ranks):
    reports = [r["disagreement"] for r in ranks]
    for report in reports:
        assert len(report["errors"]) == 1 and "noise_multiplier differs between ranks" in report["errors"][0]
        assert report["steps"] == 2  # steps 0 and 2 taken, step 1 refused on both ranks
    for a, b in zip(*(r["after_refusal"][0] for r in reports)):
        assert torch.equal(a, b)

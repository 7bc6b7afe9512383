"""Distributed DP-SGD on 2 gloo processes (CPU), different data on every rank, clipping on.

One spawned job runs all checks (a spawn costs seconds); the tests below compare
what every rank reported with a single-process oracle computed here (per-sample
gradients from a batch-size-1 autograd loop, clipped by hand) and with the reference
accountants of Opacus.
"""

import math

import pytest
import torch
import torch.nn as nn

from opacus_dp.distributed.step_clock import CLOCK_COLUMNS
from opacus_dp.optim.dp_optimizer_parts import STEP_SETTINGS
from tests.distributed.oracle import clipped_mean_update, per_sample_grads, sgd_step
from tests.distributed.spawn import run_on_ranks
from tests.distributed.workers import FLAT_C, LAYER_C, LR, make_model
from tests.distributed.workers_privacy import DELTA, distributed_job

pytestmark = pytest.mark.distributed
WORLD = 2


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Every rank's report of the one spawned job (see workers*.py)."""
    return run_on_ranks(distributed_job, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.fixture(scope="module")
def equivalence(spawned):
    return [r["equivalence"] for r in spawned]


@pytest.fixture(scope="module")
def privacy(spawned):
    return [r["privacy"] for r in spawned]


def model_at(params, template: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p, value in zip(template.parameters(), params):
            p.copy_(value)
    return template


def concatenated_step(per_rank_batches):
    """All physical batches of one logical step, all ranks, as one batch."""
    xs = [x for batches in per_rank_batches for x, _ in batches]
    ys = [y for batches in per_rank_batches for _, y in batches]
    return torch.cat(xs), torch.cat(ys)


def replay(results, key, clip):
    """One process, plain SGD on the concatenated batches, clipped by hand (σ = 0)."""
    model = model_at(results[0][key]["start"], make_model(seed=0))
    loss_fn = nn.CrossEntropyLoss()
    clipped_any = False
    for step in range(len(results[0][key]["batches"])):
        x, y = concatenated_step([r[key]["batches"][step] for r in results])
        if len(x):
            samples = per_sample_grads(model, loss_fn, x, y)
            norms = [torch.cat([g.flatten() for g in s]).norm() for s in samples]
            clipped_any |= max(norms) > (clip if not isinstance(clip, list) else min(clip))
            update = clipped_mean_update(model, loss_fn, x, y, clip, results[0][key]["global_batch"])
            sgd_step(model, update, LR)
    return [p.detach() for p in model.parameters()], clipped_any


def assert_bit_identical(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "ranks applied different updates"


CONFIGS = [(api, wrapper, clipping) for api in ("modern", "classic")
           for wrapper in ("ddp", "dpddp") for clipping in ("flat", "per_layer")]
CONFIGS.append(("classic", "ddp_static_graph", "flat"))  # keeps DDP's own synchronisation


@pytest.mark.parametrize("api,wrapper,clipping", CONFIGS)
def test_sigma_zero_equals_one_process_on_the_concatenated_batch(equivalence, api, wrapper, clipping):
    key = (api, wrapper, clipping)
    r0, r1 = equivalence[0][key], equivalence[1][key]
    assert_bit_identical(r0["start"], r1["start"])  # rank 0's parameters were broadcast
    assert not torch.equal(r0["batches"][0][0][0], r1["batches"][0][0][0]), "ranks must see different data"
    assert_bit_identical(r0["final"], r1["final"])
    clip = FLAT_C if clipping == "flat" else [LAYER_C] * 4
    expected, clipped_any = replay(equivalence, key, clip)
    assert clipped_any, "clipping must be active for this comparison to mean anything"
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["ddp", "dpddp"])
def test_batch_memory_manager_with_uneven_piece_counts_and_a_buffer(equivalence, wrapper):
    """Ranks cut their own Poisson batches into different numbers of pieces (forward calls),
    and the model has a buffer: DDP's forward-time collectives (buffer broadcast, bucket
    rebuild) would pair with another rank's all-reduce and block; the run must finish and
    equal one process on the concatenated batches."""
    key = ("buffered", wrapper)
    r0, r1 = equivalence[0][key], equivalence[1][key]
    counts = [[len(step) for step in r["batches"]] for r in (r0, r1)]
    assert counts[0] != counts[1], f"the piece counts should differ between ranks: {counts}"
    assert_bit_identical(r0["final"], r1["final"])
    expected, clipped_any = replay(equivalence, key, FLAT_C)
    assert clipped_any
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("wrapper", ["ddp", "dpddp"])
def test_empty_local_batch_takes_part_in_the_step(equivalence, wrapper):
    key = ("empty", wrapper)
    r0, r1 = equivalence[0][key], equivalence[1][key]
    assert any(len(x) == 0 for step in r1["batches"] for x, _ in step)
    assert_bit_identical(r0["final"], r1["final"])
    expected, _ = replay(equivalence, key, FLAT_C)
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_one_all_reduce_of_the_clipped_sums_per_step(equivalence, privacy):
    r = equivalence[0][("modern", "ddp", "flat")]
    numel = sum(p.numel() for p in r["start"])
    steps = len(r["batches"])
    assert r["all_reduces"] == steps
    agreement = WORLD * (len(STEP_SETTINGS) + CLOCK_COLUMNS)  # the step's settings and clock, one row per rank (distributed/reducers.py)
    assert r["reducer_bytes"] == steps * (numel + agreement) * 8  # float64, once per logical step
    assert privacy[0]["noise_ddp"]["ddp_grads_stayed_local"], "DDP must not all-reduce unclipped grads"


@pytest.mark.parametrize("run", ["noise_ddp", "noise_dpddp", "classic_philox", "classic_threads"])
def test_noise_added_once_with_std_sigma_c_over_global_batch(privacy, run):
    """One draw of N(0, σ²C²) per coordinate and step, whatever the wrapper, API or generator (the
    classic runs: fast_noise="philox" and True under DDP)."""
    r0, r1 = privacy[0][run], privacy[1][run]
    assert_bit_identical(r0["after_first"], r1["after_first"])
    if "final" in r0:
        assert_bit_identical(r0["final"], r1["final"])
    x = torch.cat([r0["batch"][0], r1["batch"][0]])
    y = torch.cat([r0["batch"][1], r1["batch"][1]])
    model = model_at(r0["start"], nn.Linear(x.shape[1], 100, bias=False).to(r0["start"][0].dtype))
    signal = clipped_mean_update(model, nn.CrossEntropyLoss(), x, y, 1.0, r0["global_batch"])[0]
    noise = (r0["start"][0] - r0["after_first"][0]) / 1.0 - signal  # lr = 1
    expected_std = r0["sigma"] * 1.0 / r0["global_batch"]
    n = noise.numel()
    assert abs(noise.std().item() / expected_std - 1) < 0.03
    assert abs(noise.mean().item()) < 5 * expected_std / math.sqrt(n)


def _reference_epsilon(mechanism, history, delta):
    from opacus.accountants import PRVAccountant, RDPAccountant

    accountant = PRVAccountant() if mechanism == "prv" else RDPAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("wrapper,mechanism", [("ddp", "prv"), ("dpddp", "rdp")])
def test_epsilon_identical_on_ranks_and_equal_to_one_process(privacy, wrapper, mechanism):
    from opacus_dp.accountants import create_accountant

    r0, r1 = privacy[0][f"noise_{wrapper}"], privacy[1][f"noise_{wrapper}"]
    assert r0["epsilon"] == r1["epsilon"]
    global_rate = 8 * WORLD / 64  # DistributedSampler batches of 8 per rank, 64 samples
    assert r0["sample_rate"] == pytest.approx(global_rate)
    assert r0["history"] == r1["history"] == [(r0["sigma"], r0["sample_rate"], r0["steps"])]
    single = create_accountant(mechanism)
    for _ in range(r0["steps"]):
        single.step(noise_multiplier=r0["sigma"], sample_rate=global_rate)
    assert r0["epsilon"] == pytest.approx(single.get_epsilon(DELTA), rel=1e-9)
    assert r0["epsilon"] == pytest.approx(_reference_epsilon(mechanism, r0["history"], DELTA), rel=2e-2)


def test_classic_api_uses_the_global_sample_rate(privacy, equivalence):
    from opacus.accountants import RDPAccountant

    r0, r1 = privacy[0]["classic"], privacy[1]["classic"]
    q = 4 * WORLD / 48
    assert r0["sample_rate"] == r1["sample_rate"] == pytest.approx(q)
    assert equivalence[0][("classic", "ddp", "flat")]["sample_rate"] == pytest.approx(q)
    assert r0["epsilon"] == r1["epsilon"]
    reference = RDPAccountant()
    reference.history = [(0.9, q, 3)]
    eps, _ = reference.get_privacy_spent(delta=DELTA, alphas=r0["alphas"])
    assert r0["epsilon"][0] == pytest.approx(eps, rel=1e-6)
    assert_bit_identical(r0["final"], r1["final"])


def test_poisson_loader_with_empty_local_batches_stays_in_step(privacy):
    r0, r1 = privacy[0]["empty_poisson"], privacy[1]["empty_poisson"]
    assert len(r0["sizes"]) == len(r1["sizes"]) == r0["steps"] == r1["steps"]
    assert 0 in r0["sizes"] + r1["sizes"]
    assert_bit_identical(r0["final"], r1["final"])


def test_distributed_poisson_sampling_end_to_end(privacy, total=200, rate=0.1):
    e0, e1 = privacy[0]["sampler"], privacy[1]["sampler"]
    for epoch in range(2):
        s0, s1 = set(e0[epoch]["shard"]), set(e1[epoch]["shard"])
        assert not s0 & s1 and s0 | s1 == set(range(total))
        assert len(e0[epoch]["batches"]) == len(e1[epoch]["batches"])
        picks = 0
        for b0, b1 in zip(e0[epoch]["batches"], e1[epoch]["batches"]):
            assert set(b0) <= s0 and set(b1) <= s1
            picks += len(b0) + len(b1)
        trials = total * len(e0[epoch]["batches"])
        assert abs(picks / trials - rate) < 4 * math.sqrt(rate * (1 - rate) / trials)
    assert e0[0]["shard"] != e0[1]["shard"], "set_epoch must reshuffle the shards"


@pytest.mark.parametrize("case", ["secure", "secure_philox"])
def test_secure_mode_keeps_ranks_identical(privacy, case):
    assert_bit_identical(privacy[0][case], privacy[1][case])


def test_checkpoint_written_by_rank_zero_resumes_everywhere(privacy):
    c0, c1 = privacy[0]["checkpoint"], privacy[1]["checkpoint"]
    assert_bit_identical(c0["saved"], c1["saved"])
    assert_bit_identical(c0["loaded"], c0["saved"])
    assert_bit_identical(c1["loaded"], c0["saved"])
    assert_bit_identical(c0["resumed"], c1["resumed"])
    assert_bit_identical(c0["resumed"], c0["uninterrupted"])  # the same batches on every rank
    assert_bit_identical(c1["resumed"], c1["uninterrupted"])
    assert c0["history"] == c1["history"] and c0["history"][0][2] == 3
    assert c0["epsilon"] == c1["epsilon"]


def test_a_checkpoint_written_by_a_rank_that_draws_no_noise_is_refused_where_the_noise_is_drawn(privacy):
    """Under DDP only rank 0 draws the noise: rank 1's generator never advanced, and resuming
    rank 0 from it would add the first steps' noise again (noise-free differences of updates)."""
    refused = privacy[0]["checkpoint"]["saved_by_rank_1"]
    assert refused is not None and "saved by a rank that draws no noise" in refused and "rank 0" in refused
    assert privacy[1]["checkpoint"]["saved_by_rank_1"] is None  # nothing to restore there


def test_a_checkpoint_loaded_on_one_rank_only_is_refused_at_the_next_step_on_every_rank(privacy):
    """The ranks' step counts travel in the step's agreement table: a rank that started afresh
    (0 steps) beside one resumed (2 steps) would otherwise train on with a different epsilon."""
    for rank in (0, 1):
        outcome = privacy[rank]["checkpoint"]["loaded_on_rank_0_only"]
        assert outcome["error"] is not None and "steps taken" in outcome["error"], outcome
        assert "{0: 2.0, 1: 0.0}" in outcome["error"]
    assert privacy[0]["checkpoint"]["loaded_on_rank_0_only"]["steps"] == 2
    assert privacy[1]["checkpoint"]["loaded_on_rank_0_only"]["steps"] == 0


@pytest.mark.parametrize("case,words", [
    ("sample_rate", "sample_rate differs between ranks"),
    ("noise_multiplier", "noise_multiplier differs between ranks"),
    ("unwrapped", "not wrapped for distributed training"),
    ("loader_world_size", "num_replicas=3"),
    ("poisson_on_one_rank", "poisson_sampling(yes=1) differs between ranks"),
    ("adaptive_quantile_differs", "adaptive clipping target_unclipped_quantile differs between ranks"),
    ("adaptive_on_one_rank", "adaptive clipping clipbound_learning_rate differs between ranks"),
    ("sigma_changed_on_one_rank", "noise_multiplier differs between ranks at this step"),
    ("bound_changed_on_one_rank", "max_grad_norm (sensitivity) differs between ranks at this step"),
    ("uneven_accumulation", "batches merged into the step differs between ranks"),
])
def test_misconfigurations_are_refused_on_every_rank(privacy, case, words):
    for rank in range(WORLD):
        message = privacy[rank]["errors"][case]
        assert message is not None and words in message, message


def adaptive_replay(results, key):
    """One process on the concatenated batches with the adaptive bound moved by hand
    (σ = 0, σ_u = 0): ``C ← clamp(C · exp(−η (f − γ)), C_min, C_max)``, ``f`` the fraction of
    the step's samples with ``‖g_i‖ ≤ C`` counted against the global expected batch size."""
    from tests.distributed.workers import ADAPTIVE

    model = model_at(results[0][key]["start"], make_model(seed=0))
    loss_fn, bound, bounds, batch = nn.CrossEntropyLoss(), FLAT_C, [], results[0][key]["global_batch"]
    for step in range(len(results[0][key]["batches"])):
        x, y = concatenated_step([r[key]["batches"][step] for r in results])
        samples = per_sample_grads(model, loss_fn, x, y) if len(x) else []
        norms = [torch.cat([g.flatten() for g in s]).norm().item() for s in samples]
        if len(x):
            sgd_step(model, clipped_mean_update(model, loss_fn, x, y, bound, batch), LR)
        fraction = min(1.0, max(0.0, (sum(n <= bound for n in norms) - len(norms) / 2) / batch + 0.5))
        bound *= math.exp(-ADAPTIVE["clipbound_learning_rate"] * (fraction - ADAPTIVE["target_unclipped_quantile"]))
        bound = min(ADAPTIVE["max_clipbound"], max(ADAPTIVE["min_clipbound"], bound))
        bounds.append(bound)
    return [p.detach() for p in model.parameters()], bounds


@pytest.mark.parametrize("wrapper", ["ddp", "dpddp"])
def test_adaptive_clipping_counts_over_all_ranks(equivalence, wrapper):
    key = ("modern", wrapper, "adaptive")
    r0, r1 = equivalence[0][key], equivalence[1][key]
    assert_bit_identical(r0["final"], r1["final"])
    assert r0["bounds"] == r1["bounds"]
    expected, bounds = adaptive_replay(equivalence, key)
    assert len(set(round(b, 6) for b in bounds)) == len(bounds), "the bound must move at every step"
    assert r0["bounds"] == pytest.approx(bounds, rel=1e-12)
    for got, want in zip(r0["final"], expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_adaptive_clipping_with_noise_one_all_reduce_same_bound_everywhere(privacy):
    from opacus.accountants import RDPAccountant

    r0, r1 = privacy[0]["adaptive_noise"], privacy[1]["adaptive_noise"]
    assert r0["bounds"] == r1["bounds"] and r0["bounds"][0] != FLAT_C
    assert_bit_identical(r0["final"], r1["final"])
    steps, numel = len(r0["batches"]), sum(p.numel() for p in r0["start"])
    assert r0["all_reduces"] == steps  # the unclipped count travels in the gradients' all-reduce
    assert r0["reducer_bytes"] == steps * (numel + 1 + WORLD * (len(STEP_SETTINGS) + CLOCK_COLUMNS)) * 8  # settings + clock
    reference = RDPAccountant()  # the accountant records the total σ, not the gradient's share
    for _ in range(steps):
        reference.step(noise_multiplier=r0["sigma"], sample_rate=r0["sample_rate"])
    assert r0["epsilon"] == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)

"""Checkpoints carry the exact privacy history; classic detach leaves nothing private behind.

Reference for ε: Opacus 1.6's RDP accountant fed the same history (computed in the test).
"""

import pytest
import torch

from opacus_dp import PrivacyEngine
from opacus_dp.errors import PrivacyBudgetExceededError

from tests.review.helpers import loss_of, make_private, modern_engine, quiet, tiny_dataset, tiny_model, train


def test_resume_with_other_sigma_and_sample_rate_keeps_every_segment(tmp_path):
    from opacus.accountants import RDPAccountant as ReferenceRDP

    engine, gsm, optimizer, loader = make_private(tiny_model(), batch_size=10, noise_multiplier=1.1,
                                                  engine_kwargs=dict(accountant="rdp"))
    train(gsm, optimizer, loader, 3)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    engine2, gsm2, optimizer2, loader2 = make_private(tiny_model(seed=9), batch_size=5, noise_multiplier=0.8,
                                                      engine_kwargs=dict(accountant="rdp"))
    engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    train(gsm2, optimizer2, loader2, 2)
    assert engine2.accountant.history == [(1.1, 0.25, 3), (0.8, 0.125, 2)]
    reference = ReferenceRDP()
    for sigma, q, steps in engine2.accountant.history:
        for _ in range(steps):
            reference.step(noise_multiplier=sigma, sample_rate=q)
    assert engine2.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)


def test_checkpoint_without_privacy_history_is_refused(tmp_path):
    model = tiny_model()
    path = tmp_path / "weights_only.pt"
    torch.save({"module_state_dict": tiny_model(seed=4).state_dict()}, path)
    engine, gsm, optimizer, loader = make_private(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="privacy accountant"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a.detach(), b)


def test_checkpoint_of_another_accountant_is_converted_while_the_accountant_itself_refuses(tmp_path):
    """As in Opacus 1.6, an accountant refuses another mechanism's state (ValueError); a checkpoint
    holds only the (σ, q, steps) records, which every built-in accountant reads alike, so a PRV
    engine resumes an RDP run's checkpoint with a warning, and computes ε with PRV."""
    engine, gsm, optimizer, loader = make_private(tiny_model(), engine_kwargs=dict(accountant="rdp"))
    train(gsm, optimizer, loader, 1)
    path = tmp_path / "rdp.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    model2 = tiny_model(seed=3)
    engine2, gsm2, optimizer2, loader2 = make_private(model2, engine_kwargs=dict(accountant="prv"))
    with pytest.raises(ValueError, match="'rdp' accountant cannot be loaded into a 'prv'"):
        engine2.accountant.load_state_dict(engine.accountant.state_dict())
    assert engine2.accountant.history == []
    with pytest.warns(UserWarning, match="recorded by a 'rdp' accountant.*'prv'"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert engine2.accountant.history == engine.accountant.history
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(model2.parameters(), gsm.parameters()))


def test_checkpoint_of_another_model_leaves_model_and_history_unchanged(tmp_path):
    engine, gsm, optimizer, loader = make_private(tiny_model(), engine_kwargs=dict(accountant="rdp"))
    train(gsm, optimizer, loader, 2)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    state = torch.load(path, weights_only=False)
    name = sorted(state["module_state_dict"])[-1]
    state["module_state_dict"][name] = torch.zeros(7)  # a model of another shape
    torch.save(state, path)
    model2 = tiny_model(seed=3)
    engine2, gsm2, optimizer2, _ = make_private(model2, engine_kwargs=dict(accountant="rdp"))
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(RuntimeError, match="size mismatch"):
        engine2.load_checkpoint(path=path, module=gsm2, optimizer=optimizer2)
    assert all(torch.equal(a.detach(), b) for a, b in zip(model2.parameters(), before))
    assert engine2.accountant.history == []


def test_secure_mode_checkpoint_keeps_the_sampling_generator_secret(tmp_path):
    """The secure sampling generator is seeded once per run: its state would let a checkpoint's
    reader replay every batch. It is neither saved nor replaced by a loaded state."""
    engine, gsm, optimizer, loader = make_private(tiny_model(), engine_kwargs=dict(secure_mode=True))
    train(gsm, optimizer, loader, 2)
    path = tmp_path / "secure.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    assert "sampler_generator_state" not in torch.load(path, weights_only=False)
    plain, gsm_p, optimizer_p, loader_p = make_private(tiny_model())
    plain_path = tmp_path / "plain.pt"
    plain.save_checkpoint(path=plain_path, module=gsm_p, optimizer=optimizer_p)
    engine2, gsm2, optimizer2, loader2 = make_private(tiny_model(), engine_kwargs=dict(secure_mode=True))
    secret = loader2.generator.get_state()
    engine2.load_checkpoint(path=plain_path, module=gsm2, optimizer=optimizer2)
    assert torch.equal(loader2.generator.get_state(), secret)


def test_budget_guard_after_resume_stops_at_the_same_total(tmp_path):
    kwargs = dict(accountant="rdp", max_epsilon=5.0, max_epsilon_delta=1e-5)

    def steps_until_refused(engine, gsm, optimizer, loader):
        with pytest.raises(PrivacyBudgetExceededError):
            train(gsm, optimizer, loader, 100)
        return len(engine.accountant)

    uninterrupted = steps_until_refused(*make_private(tiny_model(), engine_kwargs=kwargs))
    engine, gsm, optimizer, loader = make_private(tiny_model(), engine_kwargs=kwargs)
    train(gsm, optimizer, loader, 2)
    path = tmp_path / "part.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer)
    resumed = make_private(tiny_model(seed=2), engine_kwargs=kwargs)
    resumed[0].load_checkpoint(path=path, module=resumed[1], optimizer=resumed[2])
    assert steps_until_refused(*resumed) == uninterrupted > 2
    assert resumed[0].get_epsilon(1e-5) <= 5.0


def test_classic_detach_leaves_no_hooks_or_state_and_reattach_continues_accounting():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, batch_size=10, sample_size=40, noise_multiplier=1.0,
                   max_grad_norm=1.0)
    x, y = tiny_dataset(40).tensors
    quiet(engine.attach, optimizer)
    loss_of(model, x[:10], y[:10]).backward()
    optimizer.step()
    engine.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
               for m in model.modules())
    assert not any("grad_sample" in vars(p) for p in model.parameters())
    assert "step" not in vars(optimizer) and not hasattr(optimizer, "privacy_engine")
    optimizer.zero_grad()
    loss_of(model, x[:10], y[:10]).backward()
    plain = [p.detach() - 0.1 * p.grad for p in model.parameters()]
    optimizer.step()  # plain SGD now: the raw gradient, no clipping, no accounting
    for a, b in zip(model.parameters(), plain):
        torch.testing.assert_close(a.detach(), b)
    assert engine.steps == 1
    quiet(engine.attach, optimizer)
    optimizer.zero_grad()
    loss_of(model, x[10:20], y[10:20]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert engine.accountant.history == [(1.0, 0.25, 2)]
    assert all(not torch.equal(a.detach(), b) for a, b in zip(model.parameters(), before))


def _saved_run(tmp_path, clipping="flat"):
    from opacus_dp.schedulers import StepGradClip

    model = tiny_model()
    bound = 1.0 if clipping == "flat" else [0.5] * len(list(model.parameters()))
    engine, gsm, optimizer, loader = make_private(model, max_grad_norm=bound, clipping=clipping,
                                                  engine_kwargs=dict(accountant="rdp"))
    scheduler = StepGradClip(optimizer, step_size=1, gamma=0.5)
    train(gsm, optimizer, loader, 2)
    scheduler.step()
    path = tmp_path / f"{clipping}.pt"
    engine.save_checkpoint(path=path, module=gsm, optimizer=optimizer, grad_clip_scheduler=scheduler)
    return path


def _assert_nothing_loaded(model, before, engine, optimizer, bound):
    assert all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), before))
    assert engine.accountant.history == [] and optimizer.max_grad_norm == bound


def test_checkpoint_refused_by_the_optimizer_changes_nothing(tmp_path):
    """The optimizer's state is loaded after model and accountant: its refusal undoes them."""
    path = _saved_run(tmp_path)
    model = tiny_model(seed=3)
    groups = [{"params": [p]} for p in model.parameters()]  # another number of parameter groups
    engine = modern_engine(accountant="rdp")
    gsm, optimizer, _ = quiet(engine.make_private, module=model, optimizer=torch.optim.SGD(groups, lr=0.1),
                              data_loader=torch.utils.data.DataLoader(tiny_dataset(), batch_size=10),
                              noise_multiplier=1.0, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="parameter groups"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer)
    _assert_nothing_loaded(model, before, engine, optimizer, 1.0)


def test_clipping_schedule_of_another_clipping_mode_is_refused_and_changes_nothing(tmp_path):
    """A per-layer schedule's bounds would switch a flat run to per-layer clipping silently."""
    from opacus_dp.schedulers import StepGradClip

    path = _saved_run(tmp_path, clipping="per_layer")
    model = tiny_model(seed=3)
    engine, gsm, optimizer, _ = make_private(model, engine_kwargs=dict(accountant="rdp"))
    scheduler = StepGradClip(optimizer, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="per-layer clipping but this optimizer clips flat"):
        engine.load_checkpoint(path=path, module=gsm, optimizer=optimizer, grad_clip_scheduler=scheduler)
    _assert_nothing_loaded(model, before, engine, optimizer, 1.0)
    assert scheduler.last_epoch == 0

"""Behaviour of the thin compatibility modules, as Opacus documents it."""

import logging

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_sequence
from torch.utils.data._utils.collate import default_collate


def test_collate_with_empty_learns_the_structure_from_the_first_batch(caplog):
    from opacus_dp.data_loader import CollateFnWithEmpty, dtype_safe, shape_safe, wrap_collate_with_empty

    collate = wrap_collate_with_empty(collate_fn=default_collate)
    full = collate([(torch.ones(3), torch.tensor(1)), (torch.ones(3), torch.tensor(0))])
    empty = collate([])
    assert [t.shape for t in empty] == [(0, 3), (0,)] and [t.dtype for t in empty] == [t.dtype for t in full]
    with caplog.at_level(logging.WARNING, logger="opacus_dp.data_loader"):
        first_empty = CollateFnWithEmpty(default_collate, sample_empty_shapes=[(0, 2)], dtypes=[torch.int32])([])
    assert first_empty[0].shape == (0, 2) and first_empty[0].dtype == torch.int32
    assert "First batch is empty" in caplog.text
    random = CollateFnWithEmpty(default_collate, rand_on_empty=True)
    random([torch.zeros(2)])
    assert random([]).shape == (1, 2)
    assert shape_safe(torch.zeros(2, 3)) == (2, 3) and shape_safe(1) == ()
    assert dtype_safe(torch.zeros(1)) == torch.float32 and dtype_safe("a") is str


def test_packed_sequence_lengths():
    from opacus_dp.utils.packed_sequences import compute_seq_lengths

    packed = pack_sequence([torch.zeros(5), torch.zeros(2), torch.zeros(2), torch.zeros(1)])
    assert compute_seq_lengths(packed.batch_sizes) == [5, 2, 2, 1]


def test_filter_dilated_rows_keeps_the_positions_the_kernel_reads():
    from opacus_dp.utils.tensor_utils import filter_dilated_rows

    tensor = torch.arange(5.0).view(1, 5).expand(5, 5)
    kept = filter_dilated_rows(tensor, (2,), (5,), (3,))
    assert torch.equal(kept[0], torch.tensor([0.0, 2.0, 4.0]))
    assert filter_dilated_rows(torch.zeros([1, 1, 3, 3, 3, 5, 5, 5]), (2, 2, 2), (5, 5, 5), (3, 3, 3)).shape == \
        (1, 1, 3, 3, 3, 3, 3, 3)


def test_stats_average_over_the_reporting_window():
    from opacus_dp.utils import stats

    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    writer = Writer()
    stats.set_global_summary_writer(writer)
    try:
        stats.clear()
        stats.add(stats.Stat(stats.StatType.TEST, "accuracy", frequency=0.5))
        for value in (1.0, 3.0, 5.0, 7.0):
            stats.update(stats.StatType.TEST, acc1=value)
        assert writer.scalars == [("TEST:accuracy/acc1", 2.0, 2), ("TEST:accuracy/acc1", 6.0, 4)]
        stats.remove("accuracy")
        assert stats.Stats == []
    finally:
        stats.set_global_summary_writer(None)
        stats.clear()


def test_0x_privacy_script_counts_epochs_times_ceil_inverse_rate(capsys):
    from opacus_dp.privacy_analysis import compute_rdp, get_privacy_spent
    from opacus_dp.scripts.compute_dp_sgd_privacy import compute_dp_sgd_privacy, main

    orders = [2, 4, 8, 16, 32]
    eps, best = compute_dp_sgd_privacy(0.3, 1.1, 2, 1e-5, orders, verbose=False)
    assert (eps, best) == get_privacy_spent(orders, compute_rdp(0.3, 1.1, 2 * 4, orders), 1e-5)
    main(["-r", "0.3", "-n", "1.1", "-e", "2", "-a", "2", "4", "8", "16", "32"])
    assert "iterated over 8 steps" in capsys.readouterr().out


def test_0x_clipping_method_names():
    from opacus_dp.utils.clipping import ClippingMethod

    assert [m.name for m in ClippingMethod] == ["STATIC", "PVALUE", "MEAN", "GMM", "OTSU"]
    assert ClippingMethod.STATIC == 0


def test_per_sample_gradient_checker_and_optimizer_params():
    from opacus_dp.optimizers.utils import params
    from opacus_dp.utils.per_sample_gradients_utils import check_per_sample_gradients_are_correct

    torch.manual_seed(0)
    assert check_per_sample_gradients_are_correct(torch.randn(6, 4, 5), nn.Linear(5, 3))
    assert check_per_sample_gradients_are_correct(torch.randn(4, 2, 6, 6), nn.Conv2d(2, 3, 3),
                                                  grad_sample_mode="functorch")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    assert params(torch.optim.SGD(model.parameters(), lr=1)) == list(model[1].parameters())


@pytest.mark.parametrize("module_name, layer, replacement", [
    ("batch_norm", nn.BatchNorm2d(64), nn.GroupNorm), ("instance_norm", nn.InstanceNorm1d(3, track_running_stats=True),
                                                       nn.InstanceNorm1d),
    ("lstm", nn.LSTM(3, 3), nn.Module), ("gru", nn.GRU(3, 3), nn.Module),
    ("multihead_attention", nn.MultiheadAttention(4, 2), nn.Module),
])
def test_1x_per_layer_validator_modules(module_name, layer, replacement):
    import importlib

    module = importlib.import_module(f"opacus_dp.validators.{module_name}")
    (error,) = module.validate(layer)
    assert str(error).startswith(f"model ({type(layer).__name__})")
    fixed = module.fix(layer)
    assert isinstance(fixed, replacement) and module.validate(fixed) == []


def test_registration_decorators_of_validators_utils():
    from opacus_dp.validators import ModuleValidator
    from opacus_dp.validators.errors import UnsupportedModuleError
    from opacus_dp.validators.utils import register_module_fixer, register_module_validator

    class Custom(nn.Linear):
        pass

    @register_module_validator(Custom)
    def refuse(module):
        return [UnsupportedModuleError("custom rule")]

    @register_module_fixer(Custom)
    def replace(module):
        return nn.Linear(module.in_features, module.out_features)

    try:
        assert "custom rule" in str(ModuleValidator.validate(Custom(2, 2))[0])
        assert type(ModuleValidator.fix(nn.Sequential(Custom(2, 2)))[0]) is nn.Linear
    finally:
        ModuleValidator.VALIDATORS.pop(Custom)
        ModuleValidator.FIXERS.pop(Custom)


def test_dp_data_loader_accepts_opacus_rand_on_empty_and_keeps_empty_batches():
    from torch.utils.data import TensorDataset

    from opacus_dp.data import DPDataLoader

    data = TensorDataset(torch.randn(4, 3))
    with pytest.warns(UserWarning, match="rand_on_empty"):
        loader = DPDataLoader(data, sample_rate=0.01, rand_on_empty=True, steps=3,
                              generator=torch.Generator().manual_seed(0))
    assert all(batch[0].shape[1:] == (3,) for batch in loader)

"""ModuleValidator.validate / is_valid / fix / fix_and_validate: what is flagged, and how it reads."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.errors import UnsupportedModuleError
from opacus_dp.validators import (
    IllegalModuleConfigurationError,
    ModuleValidator,
    ShouldReplaceModuleError,
    register_module_fixer,
    register_module_validator,
)


def convnet():
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 8, 3), nn.BatchNorm2d(8)),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
        self.head = nn.Linear(4, 2)


def test_message_names_path_type_reason_and_fix():
    (error,) = ModuleValidator.validate(Named())
    assert isinstance(error, ShouldReplaceModuleError) and isinstance(error, UnsupportedModuleError)
    assert str(error) == (
        "model.features.3 (BatchNorm2d) cannot be private: BatchNorm mixes samples' statistics "
        "(each output depends on the whole batch); fix: ModuleValidator.fix(model) replaces it with GroupNorm"
    )


@pytest.mark.parametrize(
    "layer, type_name, fix_text",
    [
        (nn.BatchNorm1d(4), "BatchNorm1d", "GroupNorm"),
        (nn.BatchNorm3d(4), "BatchNorm3d", "GroupNorm"),
        (nn.SyncBatchNorm(4), "SyncBatchNorm", "GroupNorm"),
        (nn.InstanceNorm2d(4, track_running_stats=True), "InstanceNorm2d", "track_running_stats=False"),
        (nn.LSTM(3, 4), "LSTM", "DPLSTM"),
        (nn.GRU(3, 4), "GRU", "DPGRU"),
        (nn.RNN(3, 4), "RNN", "DPRNN"),
        (nn.MultiheadAttention(4, 2), "MultiheadAttention", "DPMultiheadAttention"),
    ],
)
def test_flagged_layers(layer, type_name, fix_text):
    model = nn.Sequential(nn.Linear(3, 3), layer)
    (error,) = ModuleValidator.validate(model)
    assert str(error).startswith(f"model.1 ({type_name}) cannot be private: ")
    assert "fix: " in str(error) and fix_text in str(error)
    assert not ModuleValidator.is_valid(model)


@pytest.mark.parametrize(
    "layer",
    [
        nn.Linear(3, 3),
        nn.GroupNorm(1, 3),
        nn.LayerNorm(3),
        nn.InstanceNorm1d(3, affine=True),
        nn.Embedding(5, 3),
        nn.Bilinear(3, 3, 3),  # no dedicated sampler needed: generic fallback
    ],
)
def test_per_sample_layers_are_valid(layer):
    assert ModuleValidator.validate(nn.Sequential(layer)) == []


def test_frozen_recurrent_attention_and_batchnorm_layers_pass_validation():
    """A frozen BatchNorm passes (as in Opacus); that it runs in eval mode is checked at every
    forward call (tests/grad_sample/test_frozen_batch_norm.py). A trainable one is flagged."""
    lstm, attention, batch_norm = nn.LSTM(3, 4), nn.MultiheadAttention(4, 2), nn.BatchNorm1d(4)
    for module in (lstm, attention, batch_norm):
        module.requires_grad_(False)
    model = nn.Sequential(nn.Linear(3, 3), lstm, attention, batch_norm)
    assert ModuleValidator.validate(model) == []
    batch_norm.weight.requires_grad_(True)
    (error,) = ModuleValidator.validate(model)
    assert str(error).startswith("model.3 (BatchNorm1d)")


def test_attention_with_only_its_output_projection_trainable_is_flagged():
    """torch's attention applies ``out_proj``'s weights inside its fused call, not through
    the ``out_proj`` module: a trainable ``out_proj`` alone still needs the replacement."""
    attention = nn.MultiheadAttention(4, 2)
    attention.in_proj_weight.requires_grad_(False)
    attention.in_proj_bias.requires_grad_(False)
    (error,) = ModuleValidator.validate(nn.Sequential(attention))
    assert str(error).startswith("model.0 (MultiheadAttention)") and "DPMultiheadAttention" in str(error)


def test_eval_mode_is_an_error_as_in_opacus_1x():
    model = nn.Sequential(nn.Linear(3, 2)).eval()
    (error,) = ModuleValidator.validate(model)
    assert isinstance(error, IllegalModuleConfigurationError) and not ModuleValidator.is_valid(model)
    assert "model (Sequential) is in eval mode" in str(error) and "model.train()" in str(error)
    assert ModuleValidator.is_valid(model.train())
    model[0].eval()  # only the root's mode counts (Opacus 1.x)
    assert ModuleValidator.is_valid(model)


def test_no_trainable_parameters_is_an_error():
    model = nn.Sequential(nn.Linear(3, 2)).requires_grad_(False)
    (error,) = ModuleValidator.validate(model)
    assert isinstance(error, IllegalModuleConfigurationError)
    assert "model (Sequential) has no trainable parameters" in str(error) and "requires_grad=True" in str(error)
    assert not ModuleValidator.is_valid(nn.ReLU())


def test_lazy_modules_are_flagged():
    (error,) = ModuleValidator.validate(nn.Sequential(nn.LazyLinear(2)))
    assert "model.0 (LazyLinear)" in str(error) and "forward pass" in str(error)


def test_root_module_path():
    (error,) = ModuleValidator.validate(nn.BatchNorm1d(3))
    assert str(error).startswith("model (BatchNorm1d) cannot be private")


def test_strict_raises_all_problems_at_once():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.LSTM(3, 3))
    with pytest.raises(UnsupportedModuleError) as info:
        ModuleValidator.validate(model, strict=True)
    text = str(info.value)
    assert "model.0 (BatchNorm1d)" in text and "model.1 (LSTM)" in text
    assert len(info.value.errors) == 2


def test_fix_returns_a_fixed_copy_and_leaves_the_original():
    model = convnet()
    fixed = ModuleValidator.fix(model)
    assert isinstance(model[0][3], nn.BatchNorm2d)
    assert isinstance(fixed[0][3], nn.GroupNorm) and fixed[0][3].num_groups == 8
    assert ModuleValidator.validate(fixed) == []
    assert fixed[0][0].weight is not model[0][0].weight
    torch.testing.assert_close(fixed[0][0].weight, model[0][0].weight)


class SharedLayers(nn.Module):
    """One BatchNorm and one LSTM object, each reachable at two paths and called twice."""

    def __init__(self):
        super().__init__()
        self.norm, self.lstm = nn.BatchNorm1d(4), nn.LSTM(4, 4, batch_first=True)
        self.again = nn.ModuleDict({"norm": self.norm, "lstm": self.lstm})

    def forward(self, x):
        h = self.again["norm"](self.norm(x.transpose(1, 2))).transpose(1, 2)
        return self.again["lstm"](self.lstm(h)[0])[0]


def test_fix_replaces_a_module_at_every_path_and_keeps_it_shared():
    model = SharedLayers().eval()
    fixed = ModuleValidator.fix(model)
    assert fixed.again["lstm"] is fixed.lstm and type(fixed.lstm).__name__ == "DPLSTM"
    assert fixed.again["norm"] is fixed.norm and isinstance(fixed.norm, nn.GroupNorm)
    assert ModuleValidator.validate(fixed.train()) == []
    assert sum(1 for _ in fixed.parameters()) == sum(1 for _ in fixed.norm.parameters()) + sum(
        1 for _ in fixed.lstm.parameters())
    no_norms = SharedLayers().eval()
    no_norms.norm = no_norms.again["norm"] = nn.Identity()
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(ModuleValidator.fix(no_norms)(x), no_norms(x))


def test_fixed_model_is_valid_for_the_reference_library_too():
    from opacus.validators import ModuleValidator as ReferenceValidator

    model = nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
    )
    assert not ReferenceValidator.is_valid(model)
    assert ReferenceValidator.is_valid(ModuleValidator.fix(model))


def test_fix_and_validate():
    fixed = ModuleValidator.fix_and_validate(convnet(), num_groups=2)
    assert fixed[0][3].num_groups == 2
    with pytest.raises(UnsupportedModuleError, match="no trainable parameters"):
        ModuleValidator.fix_and_validate(nn.Sequential(nn.BatchNorm1d(3)).requires_grad_(False))


def test_fix_errors_name_the_module():
    with pytest.raises(ValueError, match=r"model\.0\.3 \(BatchNorm2d\).*num_groups=3.*divisor.*8"):
        ModuleValidator.fix(convnet(), num_groups=3)
    with pytest.raises(ValueError, match="mutually exclusive"):
        ModuleValidator.fix(convnet(), num_groups=2, replace_bn_with_in=True)
    with pytest.raises(TypeError, match="nn.Module"):
        ModuleValidator.validate("model")


class Mixer(nn.Module):
    """Averages over the batch: a custom module that mixes samples."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.scale * x.mean(0, keepdim=True)


def test_registered_validator_and_fixer():
    @register_module_validator(Mixer)
    def validate_mixer(module):
        return [UnsupportedModuleError("it averages over the batch")]

    @register_module_fixer([Mixer])
    def fix_mixer(module):
        return nn.Identity()

    try:
        (error,) = ModuleValidator.validate(nn.Sequential(nn.Linear(2, 2), Mixer()))
        assert str(error) == "model.1 (Mixer) cannot be private: it averages over the batch"
        fixed = ModuleValidator.fix(nn.Sequential(nn.Linear(2, 2), Mixer()))
        assert isinstance(fixed[1], nn.Identity)
    finally:
        ModuleValidator.VALIDATORS.pop(Mixer)
        ModuleValidator.FIXERS.pop(Mixer)


@pytest.mark.parametrize("kwargs, words", [({"max_norm": 1.0}, "max_norm"), ({"sparse": True}, "sparse")])
def test_embedding_options_without_per_sample_form_are_flagged(kwargs, words):
    import torch.nn as nn

    from opacus_dp.grad_sample import GradSampleModule
    from opacus_dp.validators import ModuleValidator

    model = nn.Sequential(nn.Embedding(5, 2, **kwargs))
    errors = ModuleValidator.validate(model)
    assert len(errors) == 1 and words in str(errors[0]) and "0 (Embedding)" in str(errors[0])
    assert not ModuleValidator.is_valid(model)
    assert not GradSampleModule.is_supported(model)


def test_calibration_counts_every_step_despite_round_off():
    from opacus_dp.accountants.calibration import planned_steps

    assert planned_steps(sample_rate=1 / 75, epochs=3) == 225
    assert planned_steps(sample_rate=0.35, epochs=1) == 3


def _parametrized(kind):
    from torch.nn.utils import parametrizations

    layer = nn.Linear(6, 4)
    make = {"weight_norm": parametrizations.weight_norm, "spectral_norm": parametrizations.spectral_norm,
            "orthogonal": parametrizations.orthogonal}[kind]
    return nn.Sequential(make(layer), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_weights_are_refused_by_validation_and_make_private(kind):
    """A parametrization computes the weight from its originals without a batch: the fallback
    would take the weight's rows for samples and clip them (one sample's change moved the
    update by 10 C). Validation names the layer; make_private refuses in every mode."""
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_dp import PrivacyEngine
    from opacus_dp.errors import UnsupportedModuleError as EngineUnsupported
    from opacus_dp.validators import ModuleValidator

    model = _parametrized(kind)
    messages = [str(e) for e in ModuleValidator.validate(model)]
    assert any(m.startswith("model.0 (ParametrizedLinear)") and "parametrize" in m for m in messages)
    for mode in ("hooks", "functorch", "bk", "ghost", "auto"):
        with pytest.raises(EngineUnsupported, match=r"0 \(ParametrizedLinear\).*remove_parametrizations"):
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(torch.randn(4, 6)), batch_size=4),
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                criterion=nn.MSELoss() if mode == "ghost" else None)


def test_removed_parametrization_validates_clean():
    from torch.nn.utils import parametrize

    from opacus_dp.validators import ModuleValidator

    model = _parametrized("weight_norm")
    parametrize.remove_parametrizations(model[0], "weight")
    assert ModuleValidator.validate(model) == []


class _ScaledByContainer(nn.Module):
    """Its forward uses a parameter held by a ParameterDict child, which has no forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)
        self.scales = nn.ParameterDict({"a": nn.Parameter(torch.ones(4))})

    def forward(self, x):
        return self.linear(x) * self.scales["a"]


@pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
def test_trainable_parameters_in_a_parameter_container_are_refused_early():
    """No hook sees a ParameterDict's parameter, whose user is its parent's forward: validation
    names the container and make_private refuses it in every mode (it failed at the first step,
    naming only the parameter); frozen, the container is accepted."""
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_dp import PrivacyEngine
    from opacus_dp.errors import UnsupportedModuleError as EngineUnsupported
    from opacus_dp.validators import ModuleValidator

    model = nn.Sequential(_ScaledByContainer(), nn.Linear(4, 2))
    messages = [str(e) for e in ModuleValidator.validate(model)]
    assert len(messages) == 1 and messages[0].startswith("model.0.scales (ParameterDict)")
    assert "register each parameter on the module that uses it" in messages[0]
    data = DataLoader(TensorDataset(torch.randn(4, 6)), batch_size=4)
    for mode in ("hooks", "functorch", "bk", "ghost", "auto"):
        with pytest.raises(EngineUnsupported, match=r"0\.scales \(ParameterDict\).*target_modules"):
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=data,
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                criterion=nn.MSELoss() if mode == "ghost" else None)
    model[0].scales["a"].requires_grad_(False)
    assert ModuleValidator.validate(model) == []


@pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")
def test_peft_lora_on_an_embedding_is_refused_at_make_private():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_dp import PrivacyEngine
    from opacus_dp.errors import UnsupportedModuleError as EngineUnsupported

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=2, target_modules=["c_attn", "wte"], fan_in_fan_out=True))
    with pytest.raises(EngineUnsupported, match=r"transformer\.wte\.lora_embedding_A \(ParameterDict\).*target_modules"):
        PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.randint(0, 50, (4, 8))), batch_size=4),
            noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bk")

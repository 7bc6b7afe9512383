"""Every public module of Opacus 0.15 and 1.6 has its ``opacus_dp`` counterpart, or its absence is
documented in docs/compatibility.md.

The tables come from an audit of Opacus 0.15 (``git ls-tree v0.15.0 opacus``) and 1.6
(site-packages): each module, and each name of its ``__all__`` (else its top-level definitions;
for packages also what they import). ``logger`` objects are not counted.
"""

import importlib
import pathlib
import warnings

import pytest

COMPATIBILITY_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"

# (Opacus generation, opacus_dp module, public names)
PRESENT = [
    ('0.x, 1.x', 'opacus_dp', [
        'GradSampleModule', 'GradSampleModuleFastGradientClipping', 'PrivacyEngine', 'utils'
    ]),
    ('1.x', 'opacus_dp.accountants', [
        'GaussianAccountant', 'IAccountant', 'PRVAccountant', 'RDPAccountant', 'create_accountant',
        'register_accountant'
    ]),
    ('1.x', 'opacus_dp.accountants.accountant', ['IAccountant', 'T_state_dict']),
    ('1.x', 'opacus_dp.accountants.analysis', []),
    ('1.x', 'opacus_dp.accountants.analysis.gdp', [
        'compute_eps_poisson', 'compute_eps_uniform', 'compute_mu_poisson', 'compute_mu_uniform',
        'delta_eps_mu', 'eps_from_mu'
    ]),
    ('1.x', 'opacus_dp.accountants.analysis.prv', []),
    ('1.x', 'opacus_dp.accountants.analysis.rdp', ['compute_rdp', 'get_privacy_spent']),
    ('1.x', 'opacus_dp.accountants.gdp', ['GaussianAccountant']),
    ('1.x', 'opacus_dp.accountants.prv', ['PRVAccountant']),
    ('1.x', 'opacus_dp.accountants.rdp', ['RDPAccountant']),
    ('1.x', 'opacus_dp.accountants.registry', ['create_accountant', 'register_accountant']),
    ('1.x', 'opacus_dp.accountants.utils', ['MAX_SIGMA', 'get_noise_multiplier']),
    ('1.x', 'opacus_dp.data_loader', [
        'CollateFnWithEmpty', 'DPDataLoader', 'dtype_safe', 'shape_safe', 'switch_generator',
        'wrap_collate_with_empty'
    ]),
    ('1.x', 'opacus_dp.distributed', ['DifferentiallyPrivateDistributedDataParallel', 'average_gradients']),
    ('0.x', 'opacus_dp.dp_model_inspector', ['DPModelInspector', 'IncompatibleModuleException']),
    ('0.x, 1.x', 'opacus_dp.grad_sample', [
        'GradSampleModule', 'GradSampleModuleFastGradientClipping', 'get_gsm_class',
        'register_grad_sampler', 'register_norm_sampler', 'wrap_model'
    ]),
    ('0.x, 1.x', 'opacus_dp.grad_sample.conv', []),
    ('0.x, 1.x', 'opacus_dp.grad_sample.embedding', []),
    ('1.x', 'opacus_dp.grad_sample.functorch', ['ft_compute_per_sample_gradient', 'make_functional', 'prepare_layer']),
    ('0.x, 1.x', 'opacus_dp.grad_sample.grad_sample_module', ['GradSampleModule']),
    ('1.x', 'opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping', [
        'GradSampleModuleFastGradientClipping'
    ]),
    ('0.x, 1.x', 'opacus_dp.grad_sample.linear', []),
    ('0.x, 1.x', 'opacus_dp.grad_sample.utils', [
        'get_gsm_class', 'register_grad_sampler', 'register_norm_sampler', 'wrap_model'
    ]),
    ('0.x, 1.x', 'opacus_dp.layers', [
        'DPGRU', 'DPLSTM', 'DPMultiheadAttention', 'DPRNN', 'DifferentiallyPrivateDistributedDataParallel',
        'SequenceBias'
    ]),
    ('0.x', 'opacus_dp.layers.dp_ddp', ['DifferentiallyPrivateDistributedDataParallel', 'average_gradients']),
    ('0.x, 1.x', 'opacus_dp.layers.dp_multihead_attention', ['DPMultiheadAttention', 'SequenceBias']),
    ('0.x, 1.x', 'opacus_dp.layers.dp_rnn', [
        'DPGRU', 'DPGRUCell', 'DPLSTM', 'DPLSTMCell', 'DPRNN', 'DPRNNBase', 'DPRNNCell', 'DPRNNCellBase',
        'RNNLinear'
    ]),
    ('0.x, 1.x', 'opacus_dp.layers.param_rename', []),
    ('1.x', 'opacus_dp.optimizers', [
        'AdaClipDPOptimizer', 'DPOptimizer', 'DPOptimizerFastGradientClipping', 'DPPerLayerOptimizer',
        'DistributedDPOptimizer', 'DistributedDPOptimizerFastGradientClipping', 'DistributedPerLayerOptimizer',
        'FSDPOptimizerFastGradientClipping', 'SimpleDistributedPerLayerOptimizer'
    ]),
    ('1.x', 'opacus_dp.optimizers.adaclipoptimizer', ['AdaClipDPOptimizer']),
    ('1.x', 'opacus_dp.optimizers.optimizer', ['DPOptimizer']),
    ('1.x', 'opacus_dp.optimizers.optimizer_fast_gradient_clipping', ['DPOptimizerFastGradientClipping']),
    ('1.x', 'opacus_dp.optimizers.perlayeroptimizer', ['DPPerLayerOptimizer']),
    ('1.x', 'opacus_dp.optimizers.utils', ['params']),
    ('1.x', 'opacus_dp.optimizers.ddpoptimizer', ['DistributedDPOptimizer']),
    ('1.x', 'opacus_dp.optimizers.ddp_perlayeroptimizer', [
        'DistributedPerLayerOptimizer', 'SimpleDistributedPerLayerOptimizer'
    ]),
    ('1.x', 'opacus_dp.optimizers.ddpoptimizer_fast_gradient_clipping', ['DistributedDPOptimizerFastGradientClipping']),
    ('1.x', 'opacus_dp.optimizers.fsdpoptimizer_fast_gradient_clipping', ['FSDPOptimizerFastGradientClipping']),
    ('0.x', 'opacus_dp.privacy_analysis', ['compute_rdp', 'get_privacy_spent']),
    ('0.x, 1.x', 'opacus_dp.privacy_engine', ['PrivacyEngine', 'get_noise_multiplier', 'DEFAULT_ALPHAS']),
    ('1.x', 'opacus_dp.schedulers', [
        'ExponentialGradClip', 'ExponentialNoise', 'LambdaGradClip', 'LambdaNoise', 'StepGradClip',
        'StepNoise'
    ]),
    ('1.x', 'opacus_dp.schedulers.grad_clip_scheduler', [
        'ExponentialGradClip', 'LambdaGradClip', 'StepGradClip'
    ]),
    ('1.x', 'opacus_dp.schedulers.noise_scheduler', ['ExponentialNoise', 'LambdaNoise', 'StepNoise']),
    ('0.x', 'opacus_dp.scripts.compute_dp_sgd_privacy', ['compute_dp_sgd_privacy', 'main']),
    ('0.x, 1.x', 'opacus_dp.utils', []),
    ('1.x', 'opacus_dp.utils.batch_memory_manager', [
        'BatchMemoryManager', 'BatchSplittingSampler', 'wrap_data_loader'
    ]),
    ('0.x', 'opacus_dp.utils.clipping', ['ClippingMethod']),
    ('1.x', 'opacus_dp.utils.fast_gradient_clipping_utils', [
        'DPLossFastGradientClipping', 'DPTensorFastGradientClipping'
    ]),
    ('0.x', 'opacus_dp.utils.module_inspection', [
        'ModelInspector', 'get_layer_type', 'has_no_param', 'requires_grad'
    ]),
    ('0.x', 'opacus_dp.utils.module_modification', [
        'convert_batchnorm_modules', 'nullify_batchnorm_modules', 'replace_all_modules'
    ]),
    ('1.x', 'opacus_dp.utils.module_utils', [
        'are_state_dict_equal', 'clone_module', 'get_submodule', 'has_trainable_params',
        'parametrized_modules', 'requires_grad', 'trainable_modules', 'trainable_parameters'
    ]),
    ('0.x, 1.x', 'opacus_dp.utils.packed_sequences', ['compute_seq_lengths']),
    ('1.x', 'opacus_dp.utils.per_sample_gradients_utils', [
        'ModelWithLoss', 'check_per_sample_gradients_are_correct', 'clone_module',
        'compute_microbatch_grad_sample', 'compute_opacus_grad_sample', 'get_grad_sample_modes',
        'is_batch_empty'
    ]),
    ('0.x', 'opacus_dp.utils.stats', [
        'Stat', 'StatType', 'Stats', 'add', 'clear', 'remove', 'reset', 'set_global_summary_writer',
        'update'
    ]),
    ('0.x, 1.x', 'opacus_dp.utils.tensor_utils', [
        'calc_sample_norms', 'calc_sample_norms_one_layer', 'filter_dilated_rows',
        'sum_over_all_but_batch_and_last_n', 'unfold2d', 'unfold3d'
    ]),
    ('0.x, 1.x', 'opacus_dp.utils.uniform_sampler', [
        'DistributedPoissonBatchSampler', 'DistributedUniformWithReplacementSampler',
        'UniformWithReplacementSampler'
    ]),
    ('1.x', 'opacus_dp.validators', ['ModuleValidator', 'register_module_fixer', 'register_module_validator']),
    ('1.x', 'opacus_dp.validators.batch_norm', ['BATCHNORM', 'INSTANCENORM', 'fix', 'validate']),
    ('1.x', 'opacus_dp.validators.errors', [
        'IllegalModuleConfigurationError', 'NotYetSupportedModuleError', 'ShouldReplaceModuleError',
        'UnsupportableModuleError', 'UnsupportedError', 'UnsupportedModuleError'
    ]),
    ('1.x', 'opacus_dp.validators.gru', ['fix', 'validate']),
    ('1.x', 'opacus_dp.validators.instance_norm', ['INSTANCENORM', 'fix', 'validate']),
    ('1.x', 'opacus_dp.validators.lstm', ['fix', 'validate']),
    ('1.x', 'opacus_dp.validators.module_validator', ['ModuleValidator']),
    ('1.x', 'opacus_dp.validators.multihead_attention', ['fix', 'validate']),
    ('1.x', 'opacus_dp.validators.utils', [
        'DEFAULT_MODULE_VALIDATOR', 'register_module_fixer', 'register_module_validator'
    ]),
    ('0.x, 1.x', 'opacus_dp.version', []),
]

# paths ("module" or "module:name") that are deliberately absent; docs/compatibility.md says why
ABSENT = [
    "opacus_dp:PerSampleGradientClipper", "opacus_dp.per_sample_gradient_clip",
    "opacus_dp.utils.clipping:NormClipper", "opacus_dp.utils.clipping:ConstantFlatClipper",
    "opacus_dp.utils.clipping:ConstantPerLayerClipper",
    "opacus_dp.layers:RenameParamsMixin", "opacus_dp.layers.param_rename:RenameParamsMixin",
    "opacus_dp.layers.param_rename:filter_out_old_keys",
    "opacus_dp.layers.dp_rnn:RNN_CELL_TYPES", "opacus_dp.layers.dp_rnn:apply_permutation",
    "opacus_dp.grad_sample.group_norm", "opacus_dp.grad_sample.instance_norm", "opacus_dp.grad_sample.layer_norm",
    "opacus_dp.grad_sample.rms_norm", "opacus_dp.grad_sample.dp_rnn", "opacus_dp.grad_sample.dp_multihead_attention",
    "opacus_dp.grad_sample.embedding_norm_sample", "opacus_dp.grad_sample.gsm_base", "opacus_dp.grad_sample.gsm_no_op",
    "opacus_dp.grad_sample.gsm_exp_weights", "opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp",
    "opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping_tp",
    "opacus_dp.grad_sample.conv:compute_conv_grad_sample", "opacus_dp.grad_sample.linear:compute_linear_grad_sample",
    "opacus_dp.grad_sample.embedding:compute_embedding_grad_sample",
    "opacus_dp.grad_sample.utils:create_or_accumulate_grad_sample", "opacus_dp.grad_sample:prepare_module",
    "opacus_dp.grad_sample:GradSampleHooks", "opacus_dp.grad_sample:GradSampleModuleNoOp",
    "opacus_dp.grad_sample:GradSampleModuleExpandedWeights", "opacus_dp.grad_sample:AbstractGradSampleModule",
    "opacus_dp.accountants.analysis.prv.compose", "opacus_dp.accountants.analysis.prv.domain",
    "opacus_dp.accountants.analysis.prv.prvs", "opacus_dp.accountants.analysis.prv:PoissonSubsampledGaussianPRV",
    "opacus_dp.lightning",
    "opacus_dp.optimizers:DistributedDPOptimizerFastGradientlipping",
    "opacus_dp.utils.adaptive_clipping", "opacus_dp.utils.fsdp_utils",
]


def _import(module: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


@pytest.mark.parametrize("generation, module, names", PRESENT, ids=[row[1] for row in PRESENT])
def test_opacus_module_path_and_its_public_names_import(generation, module, names):
    imported = _import(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} (Opacus {generation}) lacks {missing}"


def _exists(path: str) -> bool:
    module, _, name = path.partition(":")
    try:
        imported = _import(module)
    except ImportError:
        return False
    return not name or hasattr(imported, name)


@pytest.mark.parametrize("path", ABSENT)
def test_each_absent_path_is_documented(path):
    text = COMPATIBILITY_DOC.read_text()
    section = text.split("## Paths that are deliberately absent", 1)[1].split("\n## ", 1)[0]
    module, _, name = path.partition(":")
    leaf = name or module.rpartition(".")[2]
    assert leaf in section, f"docs/compatibility.md must say why {path} is absent"
    assert not _exists(path), f"{path} exists now: move it to PRESENT"


def test_the_0x_module_inspection_helpers_behave_as_in_0x():
    import torch.nn as nn

    from opacus_dp.utils import module_inspection as mi

    inspector = mi.ModelInspector("not_bn", lambda m: not isinstance(m, nn.BatchNorm2d))
    model = nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1))
    assert not inspector.validate(model) and inspector.violators == ["1 (BatchNorm2d)"]
    model[1].requires_grad_(False)  # only modules with trainable parameters are checked
    assert mi.ModelInspector("not_bn", lambda m: not isinstance(m, nn.BatchNorm2d)).validate(model)
    everything = mi.ModelInspector("no_seq", lambda m: not isinstance(m, nn.Sequential), check_leaf_nodes_only=False)
    assert not everything.validate(model)
    assert mi.get_layer_type(nn.Linear(1, 1)) == "Linear" and mi.has_no_param(nn.ReLU())
    assert mi.requires_grad(model[0]) and not mi.requires_grad(model) and mi.requires_grad(model, True)

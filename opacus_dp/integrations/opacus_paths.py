"""Opacus module paths and their opacus_dp counterparts, for :func:`install_as_opacus`.

``OPACUS_PATHS`` maps every module of Opacus 1.6 (its installed package, walked module by module)
and the 0.x paths opacus_dp keeps (docs/compatibility.md) to the opacus_dp module that stands in
for it, or to ``None`` where there is none; ``ABSENT`` gives the reason for each ``None``.
"""

from typing import Dict, Optional

_MIGRATION = "docs/migration.md"

# Opacus modules with an opacus_dp counterpart: "opacus.X" -> "opacus_dp.X" unless listed below
_SAME_NAME = [
    "",
    ".accountants", ".accountants.accountant", ".accountants.analysis", ".accountants.analysis.gdp",
    ".accountants.analysis.prv", ".accountants.analysis.rdp", ".accountants.gdp", ".accountants.prv",
    ".accountants.rdp", ".accountants.registry", ".accountants.utils",
    ".data_loader", ".distributed",
    ".grad_sample", ".grad_sample.conv", ".grad_sample.embedding", ".grad_sample.functorch",
    ".grad_sample.grad_sample_module", ".grad_sample.grad_sample_module_fast_gradient_clipping",
    ".grad_sample.linear", ".grad_sample.utils",
    ".layers", ".layers.dp_multihead_attention", ".layers.dp_rnn", ".layers.param_rename",
    ".optimizers", ".optimizers.adaclipoptimizer", ".optimizers.ddp_perlayeroptimizer",
    ".optimizers.ddpoptimizer", ".optimizers.ddpoptimizer_fast_gradient_clipping",
    ".optimizers.fsdpoptimizer_fast_gradient_clipping", ".optimizers.optimizer",
    ".optimizers.optimizer_fast_gradient_clipping", ".optimizers.perlayeroptimizer", ".optimizers.utils",
    ".privacy_engine",
    ".schedulers", ".schedulers.grad_clip_scheduler", ".schedulers.noise_scheduler",
    ".utils", ".utils.batch_memory_manager", ".utils.fast_gradient_clipping_utils", ".utils.module_utils",
    ".utils.packed_sequences", ".utils.per_sample_gradients_utils", ".utils.tensor_utils",
    ".utils.uniform_sampler",
    ".validators", ".validators.batch_norm", ".validators.errors", ".validators.gru",
    ".validators.instance_norm", ".validators.lstm", ".validators.module_validator",
    ".validators.multihead_attention", ".validators.utils",
    ".version",
    # Opacus 0.x paths kept as re-exports
    ".privacy_analysis", ".dp_model_inspector", ".utils.module_modification", ".utils.module_inspection",
    ".utils.clipping", ".utils.stats", ".scripts", ".scripts.compute_dp_sgd_privacy", ".layers.dp_ddp",
    ".layers.dpddp",
]

# Opacus's test helpers that third-party grad-sampler tests import
_TEST_HELPERS = {
    "opacus.tests": "opacus_dp.testing",
    "opacus.tests.grad_samples": "opacus_dp.testing.grad_samples",
    "opacus.tests.grad_samples.common": "opacus_dp.testing.grad_samples.common",
}

_OWN_GRAD_SAMPLERS = ("Opacus's own per-layer grad sampler; opacus_dp's live in opacus_dp.grad_sample "
                      "and a custom one is registered with register_grad_sampler")
_OTHER_WRAPPERS = ("another GradSampleModule class of Opacus; opacus_dp has one GradSampleModule "
                   "(grad_sample_mode 'hooks', 'functorch', 'ghost', 'bk')")
_NO_FSDP_TP = "Opacus's FSDP1 / tensor-parallel path; use make_private with an FSDP2 (fully_shard) model"
_PRV_INTERNALS = ("internals of Opacus's PRV accountant; opacus_dp's PRV accountant "
                  "(opacus_dp.accountants.prv) is a different numerical implementation")
_ADAPTIVE = "adaptive clipping is make_private(..., clipping='adaptive', target_unclipped_quantile=...)"
_OPACUS_TEST = ("a test module of Opacus's own suite; only opacus.tests.grad_samples.common "
                "(GradSampleHooks_test) has an equivalent")

ABSENT: Dict[str, str] = {
    "opacus.accountants.analysis.prv.compose": _PRV_INTERNALS,
    "opacus.accountants.analysis.prv.domain": _PRV_INTERNALS,
    "opacus.accountants.analysis.prv.prvs": _PRV_INTERNALS,
    "opacus.grad_sample.dp_multihead_attention": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.dp_rnn": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.embedding_norm_sample": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.group_norm": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.instance_norm": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.layer_norm": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.rms_norm": _OWN_GRAD_SAMPLERS,
    "opacus.grad_sample.gsm_base": _OTHER_WRAPPERS,
    "opacus.grad_sample.gsm_exp_weights": _OTHER_WRAPPERS,
    "opacus.grad_sample.gsm_no_op": _OTHER_WRAPPERS,
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_fsdp": _NO_FSDP_TP,
    "opacus.grad_sample.grad_sample_module_fast_gradient_clipping_tp": _NO_FSDP_TP,
    "opacus.utils.fsdp_utils": _NO_FSDP_TP,
    "opacus.lightning": "needs PyTorch Lightning, which opacus_dp does not depend on",
    "opacus.utils.adaptive_clipping": _ADAPTIVE,
    "opacus.utils.adaptive_clipping.adaptive_clipping_utils": _ADAPTIVE,
    "opacus.per_sample_gradient_clip": "internal machinery of Opacus 0.x's engine; DPOptimizer clips",
}

_OPACUS_TESTS = [
    "accountants_test", "accounting_noise_multiplier_test", "batch_memory_manager_test", "ddp_hook_check",
    "distributed_poisson_test", "dp_layers", "dp_layers.common", "dp_layers.dp_multihead_attention_test",
    "dp_layers.dp_rnn_test", "dpdataloader_test", "grad_sample_hooks_fast_gradient_clipping_test",
    "grad_sample_hooks_test", "grad_sample_module_fast_gradient_clipping_test", "grad_sample_module_test",
    "grad_samples.conv1d_test", "grad_samples.conv2d_test", "grad_samples.conv3d_test",
    "grad_samples.dp_multihead_attention_test", "grad_samples.dp_rnn_test", "grad_samples.embedding_bag_test",
    "grad_samples.embedding_norm_sample_test", "grad_samples.embedding_test", "grad_samples.group_norm_test",
    "grad_samples.instance_norm1d_test", "grad_samples.instance_norm2d_test",
    "grad_samples.instance_norm3d_test", "grad_samples.layer_norm_test", "grad_samples.linear_test",
    "grad_samples.rms_norm_test", "grad_samples.sequence_bias_test", "gradient_accumulation_test",
    "mixed_precision_test", "mixed_precision_utils", "module_validator_test", "multidevice_optimizer_test",
    "multigpu_adaptive_clipping_test", "multigpu_fsdpcheck", "multigpu_gradcheck_test",
    "multigpu_precision_test", "per_sample_gradients_utils_test", "poisson_test", "privacy_engine_test",
    "privacy_engine_validation_test", "prv_accountant", "randomness_test", "schedulers",
    "schedulers.grad_clip_scheduler_test", "schedulers.noise_scheduler_test", "utils", "validators",
    "validators.batch_norm_test", "validators.gru_test", "validators.instance_norm_test",
    "validators.lstm_test", "validators.multihead_attention_test",
]
ABSENT.update({f"opacus.tests.{name}": _OPACUS_TEST for name in _OPACUS_TESTS})

OPACUS_PATHS: Dict[str, Optional[str]] = {
    **{f"opacus{suffix}": f"opacus_dp{suffix}" for suffix in _SAME_NAME},
    **_TEST_HELPERS,
    **{path: None for path in ABSENT},
}


def missing_message(path: str) -> str:
    """Why ``path`` cannot be imported while opacus_dp stands in for opacus."""
    if path in ABSENT:
        return (f"No module named {path!r}: opacus_dp, installed as opacus by install_as_opacus(), "
                f"has no counterpart ({ABSENT[path]}); see {_MIGRATION}, 'Libraries that import opacus'")
    return (f"No module named {path!r}: it is not a module of Opacus 1.6 that opacus_dp stands in for "
            f"(install_as_opacus() is active); see {_MIGRATION}, 'Libraries that import opacus'")

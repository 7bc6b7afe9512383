"""Hugging Face's RMS norms get their own per-sample rule (opacus_dp.grad_sample.hf_rms_norm), not
the torch.func fallback, and it equals the per-sample autograd oracle."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import hf_rms_norm
from opacus_dp.grad_sample.registry import GRAD_SAMPLERS
from tests.grad_sample.oracle import assert_grad_samples_close, gsm_grad_samples, oracle_grad_samples

CLASSES = [("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
           ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
           ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
           ("transformers.models.t5.modeling_t5", "T5LayerNorm")]


@pytest.mark.parametrize("module_name,class_name", CLASSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rule_is_registered_and_equals_the_oracle(module_name, class_name, dtype):
    module = pytest.importorskip(module_name)
    norm_type = getattr(module, class_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), norm_type(8), nn.Linear(8, 3)).to(dtype)
    nn.init.uniform_(model[1].weight, 0.5, 1.5)  # not all ones: the rule must use x̂ itself
    assert GRAD_SAMPLERS.get(norm_type) is hf_rms_norm.hf_rms_norm_grad_sample
    x = torch.randn(4, 5, 6, dtype=dtype)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-7, "rtol": 1e-6}
    assert_grad_samples_close(gsm_grad_samples(model, (x,)), oracle_grad_samples(model, (x,)), **tolerance)

"""A PEFT LoRA fine-tuning of a Llama compiled: its hooked calls (the LoRA matrices) are tapped
(``opacus_dp.grad_sample.traced_taps``) and training is the eager training."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from tests.compile.helpers import count_tapped_calls

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")

LORA_CALLS = 8  # two decoder layers, q_proj and v_proj, lora_A and lora_B


def _lora_training(mode: str, compiled: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids), batch_size=6),
            noise_multiplier=0.0, max_grad_norm=0.01, poisson_sampling=False, grad_sample_mode=mode)
    if compiled:
        private.compile(backend="aot_eager")
    for rows in (slice(0, 6), slice(0, 4), slice(1, 6)):
        optimizer.zero_grad()
        private(input_ids=ids[rows], labels=ids[rows]).loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_compiled_lora_fine_tuning_is_tapped_and_trains_as_eagerly(mode, monkeypatch):
    counts = count_tapped_calls(monkeypatch)
    expected = _lora_training(mode, compiled=False)
    got = _lora_training(mode, compiled=True)
    assert all(e.abs().max() > 0 for e in expected)  # lora_B starts at zero: it was trained
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert counts == [LORA_CALLS, LORA_CALLS]  # the first forward learns the calls

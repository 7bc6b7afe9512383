"""Full fine-tuning of tiny Hugging Face models (random weights, built from configs), every mode.

GPT-2 and BERT feed ``position_ids`` of shape ``(1, T)`` broadcast over the batch; GPT-2 has
``Conv1D`` layers and an LM head tied to the token embeddings. One σ = 0 step with clipping
active must equal the microbatch oracle (float64).
"""

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

from tests.hf.helpers import MODES, assert_private_step_matches_oracle  # noqa: E402

B, T, VOCAB = 4, 7, 101


def _ids(seed: int, shape=(B, T)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).double()


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=24,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    return transformers.BertForSequenceClassification(config).double()


TOKENS = _ids(1)
LABELS = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(2))


def _per_sequence_mean(logits, targets) -> torch.Tensor:
    """Next-token loss: per sample the mean over its tokens, then the mean over the samples."""
    per_token = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return per_token.view(len(targets), -1).mean(dim=1).mean()


def gpt2_loss(model, criterion, rows: slice) -> torch.Tensor:
    """:func:`_per_sequence_mean`; in the ghost mode through its criterion (``shape=``), whose
    loss runs the two-pass backward."""
    ids = TOKENS[rows]
    logits = model(input_ids=ids).logits[:, :-1]
    if isinstance(criterion, nn.Module):
        return _per_sequence_mean(logits, ids[:, 1:])
    return criterion(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), shape=(len(ids), T - 1))


def bert_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(input_ids=TOKENS[rows]).logits, LABELS[rows])


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_full_fine_tuning_equals_the_oracle(mode):
    assert_private_step_matches_oracle(tiny_gpt2, gpt2_loss, B, mode)


@pytest.mark.parametrize("mode", MODES)
def test_bert_full_fine_tuning_equals_the_oracle(mode):
    assert_private_step_matches_oracle(tiny_bert, bert_loss, B, mode)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_gpt2_with_explicit_position_ids_of_one_row(mode):
    """``position_ids`` passed by the caller as ``(1, T)``: the inputs still give the batch."""
    positions = torch.arange(T)[None]

    def loss(model, criterion, rows):
        ids = TOKENS[rows]
        logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]
        return _per_sequence_mean(logits, ids[:, 1:])

    assert_private_step_matches_oracle(tiny_gpt2, loss, B, mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_gpt2_from_input_embeddings(mode):
    """``inputs_embeds`` ``(B, T, d)``: the position embedding is the first layer called."""
    embeds = torch.randn(B, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def loss(model, criterion, rows):
        logits = model(inputs_embeds=embeds[rows]).logits[:, :-1]
        return _per_sequence_mean(logits, TOKENS[rows][:, 1:])

    assert_private_step_matches_oracle(tiny_gpt2, loss, B, mode)

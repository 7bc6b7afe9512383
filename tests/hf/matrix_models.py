"""Tiny models of real architectures for the compatibility matrix (``test_matrix.py``).

Every model is built from a config or constructor arguments with random weights (nothing is
downloaded), in float64, with dropout, layer drop and stochastic depth off so that the oracle
and the private step see the same function. Each :class:`Arch` pairs a builder with the loss of
a batch of samples ``rows``: the mean over the samples of their losses, written through
``criterion`` so that the ghost mode's criterion (and its two-pass backward) is used.
Builders import their library when called, so a missing library skips only its own rows.
"""

import importlib
from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn as nn

B, T, VOCAB, LABELS = 3, 6, 61, 3  # T != B: T5's relative-position table is called on (T, T)


@dataclass(frozen=True)
class Arch:
    name: str
    library: str  # the module that must be importable (pytest.importorskip)
    build: Callable[[], nn.Module]
    loss: Callable  # loss(model, criterion, rows) -> scalar
    batch_size: int = B


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


TOKENS = torch.randint(1, VOCAB, (B, T), generator=_gen(11))
TARGETS = torch.randint(1, VOCAB, (B, T - 2), generator=_gen(12))  # seq2seq targets: length != T
CLASSES = torch.randint(0, LABELS, (B,), generator=_gen(13))
IMAGES = torch.randn(B, 3, 16, 16, generator=_gen(14), dtype=torch.float64)
IMAGES_32 = torch.randn(B, 3, 32, 32, generator=_gen(15), dtype=torch.float64)
MELS = torch.randn(B, 8, 16, generator=_gen(16), dtype=torch.float64)  # Whisper: 2 x 8 positions
WAVES = torch.randn(B, 80, generator=_gen(17), dtype=torch.float64)
SQUARE = torch.randint(1, VOCAB, (4, 4), generator=_gen(18))  # T5's hazard: length == batch size


def _tokens_mean(criterion, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample the mean over its tokens, then the mean over the samples."""
    n, length, vocab = logits.shape
    if isinstance(criterion, nn.Module):
        per_token = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1),
                                                reduction="none")
        return per_token.view(n, length).mean(dim=1).mean()
    return criterion(logits.reshape(-1, vocab), targets.reshape(-1), shape=(n, length))


def causal_lm_loss(model, criterion, rows: slice) -> torch.Tensor:
    ids = TOKENS[rows]
    return _tokens_mean(criterion, model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def classify_tokens_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(input_ids=TOKENS[rows]).logits, CLASSES[rows])


def seq2seq_loss(model, criterion, rows: slice) -> torch.Tensor:
    """Teacher forcing: the decoder reads the targets shifted right (the model's own shift)."""
    logits = model(input_ids=TOKENS[rows], labels=TARGETS[rows]).logits
    return _tokens_mean(criterion, logits, TARGETS[rows])


def seq2seq_square_loss(model, criterion, rows: slice) -> torch.Tensor:
    """:func:`seq2seq_loss` on 4 samples of 4 tokens, decoder targets of 4 tokens: ``T = B``."""
    logits = model(input_ids=SQUARE[rows], labels=SQUARE[rows].flip(1)).logits
    return _tokens_mean(criterion, logits, SQUARE[rows].flip(1))


def speech_to_text_loss(model, criterion, rows: slice) -> torch.Tensor:
    logits = model(input_features=MELS[rows], labels=TARGETS[rows]).logits
    return _tokens_mean(criterion, logits, TARGETS[rows])


def classify_waves_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(input_values=WAVES[rows]).logits, CLASSES[rows])


def hf_image_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(pixel_values=IMAGES[rows]).logits, CLASSES[rows])


def image_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(IMAGES[rows]), CLASSES[rows])


def image_32_loss(model, criterion, rows: slice) -> torch.Tensor:
    return criterion(model(IMAGES_32[rows]), CLASSES[rows])


# ---------------------------------------------------------------------------- transformers


def _hf(config_name: str, model_name: str, **config) -> nn.Module:
    transformers = importlib.import_module("transformers")
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return model.double()


_ENCODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                num_labels=LABELS)


def roberta() -> nn.Module:
    return _hf("RobertaConfig", "RobertaForSequenceClassification", max_position_embeddings=16,
               pad_token_id=0, bos_token_id=0, eos_token_id=0, **_ENCODER)


def distilbert() -> nn.Module:
    return _hf("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=VOCAB, dim=16,
               n_layers=2, n_heads=2, hidden_dim=24, dropout=0.0, attention_dropout=0.0,
               seq_classif_dropout=0.0, max_position_embeddings=16, num_labels=LABELS, pad_token_id=0)


def t5() -> nn.Module:
    """Encoder-decoder; the token table is shared by both stacks and the LM head (tied)."""
    return _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=16, d_kv=8,
               d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
               relative_attention_num_buckets=8, relative_attention_max_distance=16,
               dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1)


_DECODER = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                max_position_embeddings=16, attention_dropout=0.0, tie_word_embeddings=False,
                pad_token_id=0, bos_token_id=0, eos_token_id=0)


def llama() -> nn.Module:
    return _hf("LlamaConfig", "LlamaForCausalLM", num_attention_heads=2, num_key_value_heads=2,
               **_DECODER)


def qwen2() -> nn.Module:
    """Grouped-query attention: 4 query heads share 2 key/value heads; q/k/v have biases."""
    return _hf("Qwen2Config", "Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
               **_DECODER)


def mistral() -> nn.Module:
    """Grouped-query attention (4 query heads, 1 key/value head) with a sliding window."""
    return _hf("MistralConfig", "MistralForCausalLM", num_attention_heads=4, num_key_value_heads=1,
               sliding_window=4, **_DECODER)


def vit() -> nn.Module:
    """The class token and position table are parameters of ``ViTEmbeddings`` itself."""
    return _hf("ViTConfig", "ViTForImageClassification", image_size=16, patch_size=4, num_channels=3,
               **_ENCODER)


def whisper() -> nn.Module:
    """Two ``Conv1d`` over log-mel frames, encoder-decoder, LM head tied to the decoder tokens."""
    return _hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, num_mel_bins=8,
               d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
               max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
               decoder_start_token_id=0, suppress_tokens=None, begin_suppress_tokens=None)


_WAV2VEC2 = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                 conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(6, 3), num_conv_pos_embeddings=4,
                 num_conv_pos_embedding_groups=2, feat_extract_norm="group", hidden_dropout=0.0,
                 activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
                 final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=8,
                 num_labels=LABELS)


def wav2vec2() -> nn.Module:
    """Strided ``Conv1d`` feature encoder (GroupNorm on its first layer); the convolutional
    position embedding is weight-normalised by ``torch.nn.utils.parametrize``."""
    return _hf("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", **_WAV2VEC2)


def wav2vec2_plain_position_conv() -> nn.Module:
    """:func:`wav2vec2` with the weight norm folded into a plain ``Conv1d`` weight."""
    model = wav2vec2()
    conv = model.wav2vec2.encoder.pos_conv_embed.conv
    torch.nn.utils.parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
    return model


def t5_frozen_position_bias() -> nn.Module:
    """:func:`t5` with its relative-position tables frozen (they are called without a batch)."""
    model = t5()
    for name, param in model.named_parameters():
        if "relative_attention_bias" in name:
            param.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------- peft LoRA


def _lora(base: nn.Module, targets: Tuple[str, ...], fan_in_fan_out: bool = False) -> nn.Module:
    """LoRA adapters (rank 4) on ``targets``; only they are trainable. ``init_lora_weights=False``
    draws both factors at random, so both get nonzero gradients (the default starts B at 0)."""
    peft = importlib.import_module("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets),
                             init_lora_weights=False, fan_in_fan_out=fan_in_fan_out)
    return peft.get_peft_model(base, config).double()


def lora_gpt2() -> nn.Module:
    base = _hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB,
               n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
               eos_token_id=0)
    return _lora(base, ("c_attn", "c_fc"), fan_in_fan_out=True)  # GPT-2's Conv1D: (in, out) weights


def lora_llama() -> nn.Module:
    return _lora(llama(), ("q_proj", "v_proj", "down_proj"))


# ---------------------------------------------------------------------------- timm


def _fixed(model: nn.Module) -> nn.Module:
    validators = importlib.import_module("opacus_dp.validators")
    return validators.ModuleValidator.fix(model).double()


def timm_convnext() -> nn.Module:
    """LayerNorm2d, depthwise 7x7 convolutions and the per-block layer scale ``gamma`` (a
    parameter of the block itself); ``ls_init_value`` large enough for the blocks to matter."""
    convnext = importlib.import_module("timm.models.convnext")
    torch.manual_seed(0)
    return _fixed(convnext.ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=LABELS,
                                    ls_init_value=0.5, drop_rate=0.0, drop_path_rate=0.0))


def timm_resnet() -> nn.Module:
    resnet = importlib.import_module("timm.models.resnet")
    torch.manual_seed(0)
    return _fixed(resnet.ResNet(resnet.BasicBlock, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16),
                                stem_width=8, output_stride=16, num_classes=LABELS,
                                zero_init_last=False))


def timm_vit() -> nn.Module:
    """The class token and position table are parameters of the root module."""
    vision_transformer = importlib.import_module("timm.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2,
                                                 num_heads=2, mlp_ratio=1.5, num_classes=LABELS)
    return _fixed(model)


# ---------------------------------------------------------------------------- torchvision


def torchvision_resnet18() -> nn.Module:
    models = importlib.import_module("torchvision.models")
    torch.manual_seed(0)
    return _fixed(models.resnet18(num_classes=LABELS))


def torchvision_mobilenet_v3_small() -> nn.Module:
    models = importlib.import_module("torchvision.models")
    torch.manual_seed(0)
    return _fixed(models.mobilenet_v3_small(num_classes=LABELS, width_mult=0.25, dropout=0.0))


ARCHITECTURES = [
    Arch("RoBERTa", "transformers", roberta, classify_tokens_loss),
    Arch("DistilBERT", "transformers", distilbert, classify_tokens_loss),
    Arch("T5", "transformers", t5, seq2seq_loss),
    Arch("T5 (position bias frozen)", "transformers", t5_frozen_position_bias, seq2seq_loss),
    Arch("Llama", "transformers", llama, causal_lm_loss),
    Arch("Qwen2 (GQA)", "transformers", qwen2, causal_lm_loss),
    Arch("Mistral (GQA)", "transformers", mistral, causal_lm_loss),
    Arch("ViT", "transformers", vit, hf_image_loss),
    Arch("Whisper", "transformers", whisper, speech_to_text_loss),
    Arch("wav2vec2", "transformers", wav2vec2, classify_waves_loss),
    Arch("wav2vec2 (plain position conv)", "transformers", wav2vec2_plain_position_conv,
         classify_waves_loss),
    Arch("GPT-2 + LoRA", "peft", lora_gpt2, causal_lm_loss),
    Arch("Llama + LoRA", "peft", lora_llama, causal_lm_loss),
    Arch("timm ConvNeXt", "timm", timm_convnext, image_32_loss),
    Arch("timm ResNet", "timm", timm_resnet, image_32_loss),
    Arch("timm ViT", "timm", timm_vit, image_loss),
    Arch("torchvision ResNet-18", "torchvision", torchvision_resnet18, image_32_loss),
    Arch("torchvision MobileNetV3-small", "torchvision", torchvision_mobilenet_v3_small,
         image_32_loss),
]

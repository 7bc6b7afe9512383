"""The six models of ``scripts/benchmark.py``, each with its batch and loss.

* ``convnet``: the CIFAR-10 convnet of the Opacus tutorial (four 3×3 convolutions with
  average pooling, 32→64→64→128 channels, a linear head), B = 128, 3×32×32;
* ``resnet``: an 8-layer ResNet with GroupNorm (a 3×3 stem and three basic blocks of two
  3×3 convolutions, 16/32/64 channels, 1×1 projections, linear head), B = 128, 3×32×32;
* ``sequence``: token embedding (vocabulary 5000, d = 256) and two pre-LayerNorm MLP blocks
  (256 → 1024 → 256, GELU, residual), mean pooled, 2 classes; B = 32, T = 128;
* ``transformer``: the same embedding and two pre-LayerNorm transformer blocks with
  DPMultiheadAttention (4 heads) and the same MLP; B = 32, T = 128;
* ``lstm``: token embedding (5000 × 64), a one-layer DPLSTM with 128 hidden units, linear
  head on the last state; B = 32, T = 64;
* ``llama``: a Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, no
  download): 4 layers, d = 256, 4 heads, MLP 688, vocabulary 1000; B = 16 sequences of T = 128
  tokens, loss :class:`NextTokenLoss` on the next-token labels.

Every model but ``llama`` is trained with ``nn.CrossEntropyLoss`` on class labels.

``layers`` selects ``opacus_dp.layers`` or ``opacus.layers`` for the DP attention / LSTM, so
each library runs its own implementation of the same architecture.
"""

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, CLASSES = 5000, 2


@dataclass
class Workload:
    """A model factory, one fixed batch, and the criterion of the step."""

    name: str
    build: Callable[[object], nn.Module]
    batch: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    description: str
    criterion: Callable[[], nn.Module] = nn.CrossEntropyLoss


def convnet(layers=None) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(32, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 64, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(64, 128, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, 10, bias=True),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(8, cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(8, cout))

    def forward(self, x):
        out = torch.relu(self.gn1(self.conv1(x)))
        return torch.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


def resnet8(layers=None) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(8, 16), nn.ReLU(),
        BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(64, 10),
    )


class MLPBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class AttentionBlock(nn.Module):
    def __init__(self, d: int, heads: int, layers):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = layers.DPMultiheadAttention(d, heads, batch_first=True)
        self.mlp = MLPBlock(d)

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.mlp(x)


class Classifier(nn.Module):
    """Embedding, a body over positions, final LayerNorm, mean pooling, linear head."""

    def __init__(self, body: nn.Module, d: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.body, self.ln, self.head = body, nn.LayerNorm(d), nn.Linear(d, CLASSES)

    def forward(self, tokens):
        return self.head(self.ln(self.body(self.emb(tokens))).mean(dim=1))


def sequence_model(layers=None) -> nn.Module:
    return Classifier(nn.Sequential(MLPBlock(256), MLPBlock(256)), 256)


def transformer(layers) -> nn.Module:
    return Classifier(nn.Sequential(AttentionBlock(256, 4, layers), AttentionBlock(256, 4, layers)), 256)


class LSTMClassifier(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.lstm = layers.DPLSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, CLASSES)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


def lstm(layers) -> nn.Module:
    return LSTMClassifier(layers)


class NextTokenLoss(nn.Module):
    """Per-sequence mean next-token cross-entropy ``ℓ_i = (1/T) Σ_t −log softmax(z_it)[y_it]``
    of logits ``z`` (``B × T × V``, or a model output with ``.logits``) and labels ``y`` (``B × T``),
    reduced over the sequences by ``reduction``: ``"mean"`` (``(1/B) Σ_i ℓ_i``, the token mean as
    all sequences have T tokens), ``"sum"``, or ``"none"`` (the vector of ``ℓ_i``, which Opacus's
    ghost criterion asks for: one sequence is one sample)."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, labels: torch.Tensor) -> torch.Tensor:
        logits = getattr(logits, "logits", logits)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        per_sequence = per_token.view(labels.shape).mean(dim=1)
        if self.reduction == "none":
            return per_sequence
        return per_sequence.mean() if self.reduction == "mean" else per_sequence.sum()


def llama_factory(layers: int = 4, hidden: int = 256, heads: int = 4, intermediate: int = 688,
                  vocab: int = 1000, length: int = 128) -> Callable[[object], nn.Module]:
    """Builder of a randomly initialised ``transformers.LlamaForCausalLM`` of this size (no KV
    cache, positions up to ``length``); the builder ignores its argument (it has no DP layers)."""
    def build(dp_layers=None) -> nn.Module:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=length,
            use_cache=False)
        return transformers.LlamaForCausalLM(config)

    return build


def _next_tokens(batch: int, length: int, vocab: int):
    """``B`` random sequences of ``T + 1`` tokens: inputs ``t[:, :T]``, labels ``t[:, 1:]``
    (contiguous copies: Opacus's ghost mode views its inputs)."""
    def make():
        tokens = torch.randint(0, vocab, (batch, length + 1))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def llama_workload(batch: int = 16, length: int = 128, vocab: int = 1000, layers: int = 4, hidden: int = 256,
                   heads: int = 4, intermediate: int = 688) -> Workload:
    """The ``llama`` workload at these sizes."""
    build = llama_factory(layers, hidden, heads, intermediate, vocab, length)
    return Workload("llama", build, _next_tokens(batch, length, vocab),
                    f"HF LlamaForCausalLM, {layers} layers, d={hidden}, h={heads}, MLP {intermediate}, "
                    f"V={vocab}, T={length}, B={batch}", NextTokenLoss)


def _images(batch: int):
    return lambda: (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))


def _tokens(batch: int, length: int):
    return lambda: (torch.randint(0, VOCAB, (batch, length)), torch.randint(0, CLASSES, (batch,)))


WORKLOADS = {
    "convnet": Workload("convnet", convnet, _images(128), "Opacus CIFAR-10 convnet, B=128, 3x32x32"),
    "resnet": Workload("resnet", resnet8, _images(128), "ResNet-8 with GroupNorm, B=128, 3x32x32"),
    "sequence": Workload("sequence", sequence_model, _tokens(32, 128),
                         "embedding + 2 LayerNorm/MLP blocks, d=256, T=128, B=32"),
    "transformer": Workload("transformer", transformer, _tokens(32, 128),
                            "embedding + 2 DPMultiheadAttention blocks, d=256, h=4, T=128, B=32"),
    "lstm": Workload("lstm", lstm, _tokens(32, 64), "embedding + DPLSTM(64->128), T=64, B=32"),
    "llama": llama_workload(),
}

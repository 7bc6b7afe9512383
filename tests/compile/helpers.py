"""Small models and a private training run, eager or compiled, for the ``torch.compile`` tests.

Every run starts from the same weights and takes one DP-SGD step (σ = 0, a clipping bound well
below the per-sample norms, so clipping is active) per batch; the batch sizes vary, so the
compiled code also meets new shapes. The eager run is the oracle of the compiled ones.
"""

import functools
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.grad_sample.traced_taps import TracedTaps

MODES = ("hooks", "functorch", "ghost", "bk")
SIZES = (8, 6, 8)
CLIP = 0.05  # per-sample gradient norms of these models are above 0.1
RTOL, ATOL = 1e-5, 1e-6


def mlp() -> nn.Module:
    """A bare ``nn.Sequential``: dynamo does not guard on its items' hooks unless told to."""
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


class Block(nn.Module):
    """Token and position embeddings (positions broadcast over the batch), LayerNorm, one
    single-head attention, residual, mean pooling, linear head."""

    def __init__(self, vocab: int = 11, length: int = 5, dim: int = 8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(length, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        h = self.norm(self.tokens(ids) + self.positions(positions))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return self.head((h + self.out(attention @ v)).mean(dim=1))


def sequential_cnn() -> nn.Module:
    """Convolutions, activations, pooling and a head in one ``nn.Sequential`` (a layer loop)."""
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))


class OffsetScale(nn.Module):
    """A layer type of its own (per-sample gradients by ``torch.func``) with a buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.register_buffer("offset", torch.full((width,), 0.1))

    def forward(self, x):
        return self.weight * x + self.offset


def block_with_buffer() -> nn.Module:
    """The Block with its LayerNorm replaced by an :class:`OffsetScale`, which the modes that skip
    autograd's weight gradients (ghost, bk) cannot tap (no detached forward for a layer of its
    own type with buffers)."""
    block = Block()
    block.norm = OffsetScale(block.norm.normalized_shape[0])
    return block


MODELS = {"mlp": mlp, "cnn": CNN, "block": Block, "block_with_buffer": block_with_buffer,
          "sequential_cnn": sequential_cnn}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def batch(name: str, n: int):
    generator = torch.Generator().manual_seed(100 + n)
    y = torch.randint(0, 3, (n,), generator=generator)
    if name == "mlp":
        return torch.randn(n, 6, generator=generator), y
    if name == "cnn":
        return torch.randn(n, 2, 5, 5, generator=generator), y
    if name == "sequential_cnn":
        return torch.randn(n, 2, 4, 4, generator=generator), y
    return torch.randint(0, 11, (n, 5), generator=generator), y


def make_private(model: nn.Module, mode: str, name: str, module: Optional[nn.Module] = None):
    """``(private model, DP optimizer, criterion)`` for ``model`` (passed as ``module`` if given,
    e.g. its compiled form)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch(name, max(SIZES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine(accountant="rdp").make_private(
            module=model if module is None else module, optimizer=optimizer,
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)), noise_multiplier=0.0,
            max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode=mode)
    criterion = result[2] if len(result) == 4 else nn.CrossEntropyLoss()
    return result[0], result[1], criterion


def steps(private, optimizer, criterion, name: str, sizes: Sequence[int] = SIZES) -> None:
    for n in sizes:
        x, y = batch(name, n)
        optimizer.zero_grad()
        criterion(private(x), y).backward()
        optimizer.step()


def compile_after(backend) -> Callable[[nn.Module], nn.Module]:
    return lambda private: torch.compile(private, backend=backend)


def compile_in_place(backend) -> Callable[[nn.Module], nn.Module]:
    def compiled(private):
        private.compile(backend=backend)
        return private
    return compiled


def train(name: str, mode: str, *, after: Optional[Callable] = None, before=None,
          sizes: Sequence[int] = SIZES) -> List[torch.Tensor]:
    """The parameters after :func:`steps`: eager, or with the private model transformed by
    ``after`` (e.g. compiled), or with ``before(model)`` passed to ``make_private``."""
    model = build(name)
    private, optimizer, criterion = make_private(model, mode, name, None if before is None else before(model))
    if after is not None:
        private = after(private)
    steps(private, optimizer, criterion, name, sizes)
    return [p.detach().clone() for p in model.parameters()]


@functools.lru_cache(maxsize=None)
def _eager_training(name: str, mode: str, sizes: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
    return tuple(train(name, mode, sizes=sizes))


def eager_training(name: str, mode: str, sizes: Sequence[int] = SIZES) -> List[torch.Tensor]:
    """:func:`train` without compiling (the oracle), computed once per arguments."""
    return [t.clone() for t in _eager_training(name, mode, tuple(sizes))]


def assert_same_training(got: List[torch.Tensor], expected: List[torch.Tensor], start: List[torch.Tensor]) -> None:
    """Equal within float32 tolerance, and the run did move the parameters."""
    assert max((e - s).abs().max().item() for e, s in zip(expected, start)) > 1e-3
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def initial(name: str) -> List[torch.Tensor]:
    return [p.detach().clone() for p in build(name).parameters()]


def watch_tapped_calls(set_attribute: Callable, on_records: Callable[[list], None]) -> None:
    """Hand ``on_records`` the records of each tapped compiled forward (``traced_taps``: ``(path,
    args, kwargs, tap)`` per call) as the forwards run; ``set_attribute``: ``monkeypatch.setattr``,
    or ``setattr`` in a process of its own."""
    finish = TracedTaps.finish

    def watching(self):
        records = finish(self)
        on_records(records)
        return records

    set_attribute(TracedTaps, "finish", torch.compiler.disable(watching))


def count_tapped_calls(monkeypatch) -> List[int]:
    """The number of tapped calls of each compiled forward that was tapped, appended as the
    forwards run."""
    counts: List[int] = []
    watch_tapped_calls(monkeypatch.setattr, lambda records: counts.append(len(records)))
    return counts


def recording_backend() -> Tuple[List[str], Callable]:
    """``(graphs, backend)``: a dynamo backend that runs each captured graph as it is and appends
    its code to ``graphs``; dynamo's caches and counters are cleared first."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs: List[str] = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    return graphs, backend


def assert_one_mlp_graph_without_breaks(graphs: List[str]) -> None:
    """The MLP's forward was one graph, with both ``Linear``s and the ReLU, and dynamo broke none."""
    from torch._dynamo.utils import counters

    assert sum(counters["graph_break"].values()) == 0
    assert len(graphs) == 1 and graphs[0].count("linear(") >= 2 and "relu" in graphs[0]

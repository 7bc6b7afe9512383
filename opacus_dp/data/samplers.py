"""Poisson batch samplers: every step includes each example independently with probability q.

This is the sampling the privacy analysis of DP-SGD assumes (the subsampled Gaussian
mechanism: Abadi et al. 2016, "Deep Learning with Differential Privacy"; Mironov et al. 2019,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism"). The batch size is therefore
random, ``|B| ~ Binomial(N, q)``, and may be zero.
"""

from numbers import Integral, Real
from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler

from opacus_dp.data.empty_draws import register_skipping_sampler, report_empty_draw


def check_sample_rate(sample_rate) -> float:
    """``sample_rate`` as a float in (0, 1], or a ValueError naming the argument."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, Real):
        raise TypeError(f"sample_rate must be a float in (0, 1], got {type(sample_rate).__name__}")
    if not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
    return float(sample_rate)


def check_positive_int(value, name: str) -> int:
    """``value`` as a positive int, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def default_steps(sample_rate: float) -> int:
    """Number of batches of one "epoch": ``round(1/q)`` (at least 1), so that N·q·steps ≈ N."""
    return max(1, round(1.0 / sample_rate))


def generator_from_global_rng() -> torch.Generator:
    """A fresh CPU generator seeded from torch's global RNG.

    Seeding from the global RNG keeps runs reproducible under ``torch.manual_seed`` while giving
    the loader its own checkpointable state (``generator.get_state()``).
    """
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    generator = torch.Generator()
    generator.manual_seed(seed % (2**63))
    return generator


_UNIFORM_STEP = 2.0 ** -53  # torch's float64 uniforms are k · 2⁻⁵³, k uniform in [0, 2⁵³)


def poisson_mask(num_samples: int, sample_rate: float, generator) -> torch.Tensor:
    """Boolean mask with independent Bernoulli(p) entries, ``q - 2⁻⁵³ < p ≤ q``.

    ``U_i < q - 2⁻⁵³`` for float64 uniforms ``U_i = k · 2⁻⁵³``: ``p = (⌈q · 2⁵³⌉ - 1) / 2⁵³``,
    never above the rate the accountant records. (Float32 uniforms, multiples of 2⁻²⁴, would
    give ``p = ⌈q · 2²⁴⌉ / 2²⁴``: 1.19 q at q = 1e-7, 60 q at q = 1e-9.) ``q = 1``: all."""
    if sample_rate >= 1:
        return torch.ones(num_samples, dtype=torch.bool)
    return torch.rand(num_samples, generator=generator, dtype=torch.float64) < sample_rate - _UNIFORM_STEP


class UniformWithReplacementSampler(Sampler[List[int]]):
    """Batch sampler drawing ``steps`` Poisson batches over ``range(num_samples)``.

    Each draw holds the indices i with ``U_i < sample_rate`` for fresh uniforms, so each example
    is in each batch independently with probability q. ``len(sampler) == steps`` draws (default
    ``round(1/q)``). Accepts the keyword form ``(num_samples=, sample_rate=, generator=, steps=)``
    and the positional form ``(num_samples, sample_rate, generator)``.

    An empty draw (probability ``(1-q)^N``) is, by default (``skip_empty=True``), never yielded,
    as in Opacus 0.x: torch's default collate fails on an empty list. It is reported to the
    privacy engines following rate q (:mod:`opacus_dp.data.empty_draws`): the classic
    ``PrivacyEngine(..., poisson=True)`` takes its step then (noise only, parameters updated)
    and records one ``(σ, q)``, so every draw is one accounted step, empty ones included. Opacus
    0.x instead took a random (geometric) number of noise-only steps after each step, drawn
    apart from the sampler. ``skip_empty=False`` yields empty lists (Opacus 1.x; for a
    collate that builds empty batches, as :class:`~opacus_dp.data.DPDataLoader` does).
    ``draws`` counts the draws made so far, empty ones included.
    """

    logs_draw_states = True  # log_state_after_draw: a loader drawing ahead knows each batch's state
    state_log = None

    def __init__(self, num_samples: int, sample_rate: float, generator=None, steps: Optional[int] = None,
                 *, skip_empty: bool = True):
        self.num_samples = check_positive_int(num_samples, "num_samples")
        self.sample_rate = check_sample_rate(sample_rate)
        self.generator = generator
        self.steps = default_steps(self.sample_rate) if steps is None else check_positive_int(steps, "steps")
        self.skip_empty = bool(skip_empty)
        self.draws = 0
        if self.skip_empty:  # a classic engine attached later may recognise it
            register_skipping_sampler(self)

    def __len__(self) -> int:
        """Number of draws per pass (the batches yielded, when none is empty)."""
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            indices = poisson_mask(self.num_samples, self.sample_rate, self.generator).nonzero().view(-1).tolist()
            self.draws += 1
            log_state_after_draw(self)
            if indices or not self.skip_empty:
                yield indices
            else:
                report_empty_draw(self)  # its step is taken by the engine following rate q

    def expected_batch_size(self) -> float:
        """E|B| = N·q."""
        return self.num_samples * self.sample_rate


def log_state_after_draw(sampler) -> None:
    """Append the sampling generator's state to ``sampler.state_log`` (a deque a loader drawing
    ahead with worker processes sets, to know the state after each batch it hands out)."""
    log = sampler.state_log
    if log is not None and isinstance(sampler.generator, torch.Generator):
        log.append(sampler.generator.get_state())


_LOGICAL_BATCHES = [0]  # handed out in this process by the distributed DP loaders


def count_logical_batch() -> None:
    """One logical batch of a distributed DP loader reached the training loop (a draw of
    :class:`DistributedPoissonBatchSampler`, or the first piece of one in ``BatchMemoryManager``)."""
    _LOGICAL_BATCHES[0] += 1


def logical_batches_handed_out() -> int:
    """Logical batches the distributed DP loaders of this process handed out so far: each rank's
    step compares how many it got since its last step (:mod:`~opacus_dp.distributed.step_clock`)."""
    return _LOGICAL_BATCHES[0]


_SHARD_ASSIGNMENT = [0.0]  # of the pass the distributed DP samplers of this process began last


def note_shard_assignment(seed: float) -> None:
    """A distributed DP sampler began a pass whose shards are assigned by ``seed``
    (``shuffle_seed + epoch``; -1 unshuffled). Ranks of different epochs would own overlapping
    shards, so each step compares it across ranks (:mod:`~opacus_dp.distributed.step_clock`). It is
    kept modulo 256, so that it stays exact in a bfloat16 gradient bucket: ranks whose epochs differ
    by less than 256 are told apart."""
    _SHARD_ASSIGNMENT[0] = float(seed % 256) if seed >= 0 else -1.0


def shard_assignment_in_use() -> float:
    """The seed of the shard assignment last noted by :func:`note_shard_assignment`."""
    return _SHARD_ASSIGNMENT[0]


def distributed_world(num_replicas, rank):
    """(num_replicas, rank), filled in from ``torch.distributed`` when not given."""
    if num_replicas is None or rank is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(
                "DistributedPoissonBatchSampler needs num_replicas and rank, or an initialised "
                "torch.distributed process group to read them from"
            )
        num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
        rank = torch.distributed.get_rank() if rank is None else rank
    num_replicas = check_positive_int(num_replicas, "num_replicas")
    if isinstance(rank, bool) or not isinstance(rank, Integral) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, num_replicas={num_replicas}), got {rank!r}")
    return num_replicas, int(rank)


class DistributedPoissonBatchSampler(Sampler[List[int]]):
    """Poisson batch sampler for one rank of a ``torch.distributed`` job.

    Per epoch the indices ``0..N-1`` are permuted with a generator seeded by
    ``shuffle_seed + epoch`` (identity when ``shuffle=False``); rank r owns the permuted
    positions ``r, r+R, r+2R, ...``. Every step draws one mask ``U_j < q`` over all N positions
    and the rank keeps the selected positions it owns. So:

    * each example is in the global batch independently with probability q (the accountant uses q);
    * local batches of different ranks are disjoint (ranks own disjoint positions); when all
      ranks share the generator seed their union is exactly one global Poisson batch;
    * every rank yields exactly ``steps`` batches (empty ones included), so ranks never fall out
      of step in collective operations. (Opacus 0.x skipped a rank's empty local batch, which
      let ranks fall out of step; a loader over this sampler needs a collate that accepts an
      empty list, as :class:`~opacus_dp.data.DPDataLoader`'s.)

    ``set_epoch(epoch)`` changes the shard assignment for the next iteration.
    """

    logs_draw_states = True  # log_state_after_draw: a loader drawing ahead knows each batch's state
    state_log = None

    def __init__(
        self,
        *,
        total_size: int,
        sample_rate: float,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        shuffle_seed: int = 0,
        generator=None,
        steps: Optional[int] = None,
    ):
        self.total_size = check_positive_int(total_size, "total_size")
        self.sample_rate = check_sample_rate(sample_rate)
        self.num_replicas, self.rank = distributed_world(num_replicas, rank)
        self.shuffle = bool(shuffle)
        self.shuffle_seed = int(shuffle_seed)
        self.generator = generator
        self.steps = default_steps(self.sample_rate) if steps is None else check_positive_int(steps, "steps")
        self.epoch = 0
        # Local shard size: the first N mod R ranks own one more example.
        self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))
        self._sizes_of_ranks: List[int] = []  # of the batch drawn last (batch_sizes_of_ranks)

    @property
    def num_batches(self) -> int:
        """Alias of ``steps`` (name used by Opacus 1.x)."""
        return self.steps

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int) -> None:
        """Use the shard assignment of ``epoch`` on the next iteration."""
        self.epoch = int(epoch)

    def shard_indices(self) -> torch.Tensor:
        """Dataset indices owned by this rank in the current epoch (permuted positions r::R)."""
        if self.shuffle:
            shuffle_generator = torch.Generator()
            shuffle_generator.manual_seed(self.shuffle_seed + self.epoch)
            order = torch.randperm(self.total_size, generator=shuffle_generator)
        else:
            order = torch.arange(self.total_size)
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[List[int]]:
        return self.draw(count_batches=True)

    def draw(self, *, count_batches: bool) -> Iterator[List[int]]:
        """The ``steps`` local batches of one pass; ``count_batches``: count each as handed out
        (:func:`count_logical_batch`; ``BatchMemoryManager`` counts them itself, when their
        first piece reaches the loop)."""
        owned = self.shard_indices()
        note_shard_assignment(self.shuffle_seed + self.epoch if self.shuffle else -1)
        for _ in range(self.steps):
            mask = poisson_mask(self.total_size, self.sample_rate, self.generator)
            log_state_after_draw(self)
            self._sizes_of_ranks = [int(mask[r :: self.num_replicas].sum()) for r in range(self.num_replicas)]
            if count_batches:
                count_logical_batch()
            yield owned[mask[self.rank :: self.num_replicas]].tolist()

    def batch_sizes_of_ranks(self) -> List[int]:
        """The local batch size of every rank in the batch drawn last: all ranks draw the same
        global mask (shared generator), so each knows the others' sizes without communicating
        (FSDP2's ``BatchMemoryManager`` cuts every rank's batch into the same number of pieces)."""
        return list(self._sizes_of_ranks)

    def expected_batch_size(self) -> float:
        """Expected local batch size ``q · |shard|``."""
        return self.num_samples * self.sample_rate


DistributedUniformWithReplacementSampler = DistributedPoissonBatchSampler


"""Cross-rank consistency checks for distributed DP-SGD.

Every check first runs its collective on *all* ranks and only then compares, so a
disagreement raises the same error on every rank instead of leaving some ranks blocked
in a collective the others never enter.
"""

import hashlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def process_group_active() -> bool:
    """True iff ``torch.distributed`` is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def require_process_group(what: str) -> None:
    """Raise a clear error if no default process group has been initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised process group: call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first "
            "(for example in a script launched with torchrun --nproc_per_node=N)"
        )


def collective_device(group=None) -> torch.device:
    """The device collectives of ``group`` need: CUDA for nccl, CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_values(values: List[float], group=None) -> torch.Tensor:
    """All-gather a list of floats: row r of the result holds rank r's values (float64)."""
    device = collective_device(group)
    local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


def check_same_on_all_ranks(values: Dict[str, Optional[float]], group=None) -> None:
    """Raise ``ValueError`` on every rank if any named value differs between ranks.

    ``None`` values are compared as NaN-free sentinels (all ranks must agree on None too).
    """
    names = sorted(values)
    encoded = [-1.0 if values[n] is None else float(values[n]) for n in names]
    flags = [1.0 if values[n] is None else 0.0 for n in names]
    table = gather_values(encoded + flags, group)
    for i, name in enumerate(names):
        column = table[:, [i, i + len(names)]]
        if not bool((column == column[0]).all()):
            per_rank = {r: _decode(column[r]) for r in range(table.shape[0])}
            raise ValueError(
                f"{name} differs between ranks ({per_rank}); every process must use the same "
                f"{name} for distributed DP-SGD"
            )


def _decode(pair: torch.Tensor) -> Optional[float]:
    return None if pair[1].item() == 1.0 else pair[0].item()


@torch.no_grad()
def parameters_in_sync(module: nn.Module, group=None) -> bool:
    """True iff every parameter of ``module`` is bit-identical on all ranks.

    Compares rank 0's flattened parameters (broadcast) with the local ones; the answer is
    made collective (MIN over ranks), so all ranks return the same value.
    """
    params = [p.detach().reshape(-1) for p in module.parameters()]
    if not params:
        return True
    device = collective_device(group)
    local = torch.cat([p.to(device=device, dtype=torch.float64) for p in params])
    reference = local.clone()
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(reference, src=src, group=group)
    same = torch.tensor([1.0 if torch.equal(local, reference) else 0.0], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    return bool(same.item() == 1.0)


def share_generator_state(generator: torch.Generator, src: int = 0, group=None) -> None:
    """Give every rank ``src``'s state of ``generator`` (a CPU generator).

    Used for the distributed Poisson sampler: with one shared sampling stream the ranks' local
    batches (disjoint positions of one global mask) form exactly one global Poisson batch, and
    the state a checkpoint saves on any one rank resumes the sampling of every rank.
    """
    state = generator.get_state().to(collective_device(group))
    dist.broadcast(state, src=src, group=group)
    generator.set_state(state.cpu())


def check_mean_divisor(optimizer) -> None:
    """A mean over the *actual* local batch would differ per rank: refuse it."""
    if optimizer.loss_reduction == "mean" and optimizer.expected_batch_size is None:
        raise ValueError(
            "distributed DP-SGD with loss_reduction='mean' needs the expected batch size (the "
            "mean divides by expected_batch_size · world_size on every rank): pass batch_size "
            "and sample_size (classic API) or use the modern API's data loader"
        )


def _digest(value) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "big")


def check_units_agree(units, world_size: int, settings: Optional[Dict[str, object]] = None) -> None:
    """Every rank must see the same users (the same ``user_ids``), so that each user belongs to one
    rank only, and the same unit ``settings`` (the ranks draw every unit's rows from one shared
    stream); digests of both are compared across ranks (one all-reduce)."""
    if world_size <= 1:
        return
    digests = [_digest([list(u) for u in units]), _digest(sorted((settings or {}).items()))]
    extremes = torch.tensor([v for d in digests for v in (d, -d)], dtype=torch.int64, device=collective_device(None))
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if int(extremes[2]) != -int(extremes[3]):
        raise ValueError(
            f"the ranks were given different privacy-unit settings (this rank: {dict(settings or {})}): every "
            f"rank must pass the same {', '.join(sorted(settings or {}))} to make_private (the ranks draw "
            "the units' rows from one shared sampling stream)")
    if int(extremes[0]) != -int(extremes[1]):
        raise ValueError(
            "privacy_unit='user': the ranks were given different user_ids (or datasets): a user could "
            "then be split across ranks and clipped once per rank. Give every rank the same dataset "
            "and user_ids; make_private's loader assigns each user to one rank")

"""FSDP2 reducer: clipped sums reduce-scattered into the shards, each rank noising its own shard.

With per-rank clipped sums ``S_r`` of a parameter (full, unsharded shape, float32) and FSDP2's
``Shard(0)`` layout (dim 0 padded to ``W·c`` rows, rank ``r`` owns rows ``[r·c, (r+1)·c)``),
one ``reduce_scatter`` per ``fully_shard`` module hands rank ``r`` its rows of ``Σ_r S_r`` — the
collective FSDP itself runs for ordinary gradients, never an all-reduce of full gradients. The
optimizer then adds ``N(0, σ²C²)`` to those rows only, from a stream of this rank
(:mod:`~opacus_dp.distributed.noise_streams`): every coordinate of the model gets exactly one
draw, independent across ranks, and the update is

    grad_r = (Σ_r S_r)[rows of r] + N_r ,   N_r ~ 𝒩(0, σ²C² I) ,

the same distribution as one process adding noise to the whole sum (DDP's rank-0 noise).

Before the reduce-scatters, the ranks' settings and refusals travel in a ``(W, m)`` table in an
all-reduce of ``W·m`` numbers (:mod:`~opacus_dp.distributed.agreement`), so a step refused on one
rank is refused on all before any gradient moves. Its rows end with each rank's step clock, and the
same table is exchanged (bounded) before every forward and backward pass
(:mod:`~opacus_dp.distributed.fsdp_rendezvous`): FSDP2's own collectives never wait unbounded for a
rank that stopped before them, and ranks out of step are refused everywhere.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from opacus_dp.distributed.agreement import agree_alone
from opacus_dp.distributed.fsdp import DTensor, fsdp_modules, parameter_groups, shard_rows
from opacus_dp.distributed.fsdp_rendezvous import FsdpRendezvous
from opacus_dp.distributed.step_clock import STEP, StepClock
from opacus_dp.distributed.step_wait import BoundedStepWait, StepTimeout
from opacus_dp.optim.reduction import StepRelease

# torch >= 2.14 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceScatterReducer(BoundedStepWait):
    """Reduce-scatters full clipped sums into the FSDP2 shards of ``model`` (module doc).

    ``bytes_reduced`` and ``num_reduce_scatters`` count what this rank sent into the gradient
    collectives (the small agreement all-reduce is not counted).
    """

    draws_noise = True  # each rank noises its own shard after the reduction
    shards = True
    reuses_input = False
    needs_equal_passes = True  # every forward/backward pass of a fully_shard model is a collective

    def __init__(self, model, *, step_timeout: StepTimeout = None, settings: int = 1):
        self._group_of = parameter_groups(model)
        some = next(iter(self._group_of), None)
        if some is None:
            raise ValueError("ReduceScatterReducer needs a model sharded with fully_shard")
        self.mesh = some.device_mesh
        self.process_group = self.mesh.get_group()
        self.world_size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()
        self.bytes_reduced = 0
        self.num_reduce_scatters = 0
        self.step_timeout = step_timeout
        self.clock = StepClock()
        self.rendezvous = FsdpRendezvous(self, settings)  # installed by install_rendezvous(model)

    def install_rendezvous(self, model) -> None:
        """Meet the other ranks (bounded) before every forward and backward pass of ``model``."""
        self.rendezvous.install(fsdp_modules(model)[0][1])

    def close(self) -> None:
        """Remove the meeting hooks from the model."""
        self.rendezvous.remove()

    @torch.no_grad()
    def reduce(self, release: StepRelease) -> List[torch.Tensor]:
        """This rank's shard of ``Σ_ranks sums[i]`` for each ``release.params[i]`` (new tensors,
        local shard shape), noised; raises on every rank first if a rank refused or the settings
        differ. The sums are dropped as they are sent (at most one module's full-size sums and
        send buffer are alive beside the shards)."""
        tensors, release.sums = release.bucket(noised=False), []
        shards = self._reduce_scatter(tensors, release.agreed, release.refusal, release.params)
        return shards if release.refusal is not None else release.noise(shards)

    def _reduce_scatter(self, tensors: List[torch.Tensor], agreed: Optional[Dict[str, float]],
                        refusal: Optional[int], params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        names = sorted(agreed or {})
        if names or refusal is not None:
            if len(names or ["refusal"]) != self.rendezvous.settings:
                raise ValueError(f"ReduceScatterReducer was built for {self.rendezvous.settings} step "
                                 f"settings, got {len(names)}: build it with settings=len(agreed)")
            agree_alone(names or ["refusal"], [agreed[n] for n in names] or [0.0], refusal,
                        world_size=self.world_size, rank=self.rank, device=_device_of(tensors, params),
                        group=self.process_group, wait=self._wait, clock=self.clock.row(STEP),
                        after_wait=self.clock.step_over)
        if len(params) != len(tensors):
            raise ValueError("ReduceScatterReducer.reduce needs the parameter of every tensor")
        buckets = self._buckets(tensors, params)
        shards: Dict[int, torch.Tensor] = {}
        for bucket in buckets:  # one module at a time: its full-size sums are freed once sent
            shards.update(self._send(bucket))
            for i, _, _ in bucket:
                tensors[i] = None
            bucket.clear()
        return [shards[i] for i in range(len(params))]

    def _send(self, bucket) -> Dict[int, torch.Tensor]:
        """Reduce-scatter one bucket; this rank's shard of each of its tensors."""
        if self.world_size == 1:  # the one shard is the whole sum: nothing to send or copy
            return {i: t.reshape(-1) for i, t, _ in bucket}
        flat = self._scatter_input(bucket)
        out = flat.new_empty(flat.numel() // self.world_size)
        self._wait([_REDUCE_SCATTER(out, flat, group=self.process_group, async_op=True)])
        self.bytes_reduced += flat.numel() * flat.element_size()
        self.num_reduce_scatters += 1
        return _split(out, bucket)

    def _buckets(self, tensors, params) -> List[List[Tuple[int, torch.Tensor, torch.Tensor]]]:
        """Positions grouped by (``fully_shard`` module, dtype): one collective per group."""
        groups: Dict[Tuple, List] = {}
        for i, (t, p) in enumerate(zip(tensors, params)):
            if p not in self._group_of:
                raise ValueError(f"a tensor of shape {tuple(p.shape)} is not a parameter of the "
                                 "fully_shard model this optimizer was configured for")
            groups.setdefault((self._group_of[p], t.dtype, t.device), []).append((i, t, p))
        return [groups[k] for k in sorted(groups, key=lambda k: (k[0], str(k[1]), str(k[2])))]

    def _scatter_input(self, bucket) -> torch.Tensor:
        """``[rank 0's rows of every tensor | rank 1's rows | …]``, each padded to ``c`` rows."""
        pieces = []
        for _, t, p in bucket:
            chunk, _, _ = shard_rows(p)
            full = t.reshape(p.shape) if p.dim() > 0 else t.reshape(1)
            padded = F.pad(full.reshape(full.shape[0], -1), (0, 0, 0, chunk * self.world_size - full.shape[0]))
            pieces.append(padded.reshape(self.world_size, -1))
        return torch.cat(pieces, dim=1).reshape(-1)

    def as_grad(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The shard ``value`` as ``param``'s gradient: a ``DTensor`` laid out as ``param``."""
        local = value.to(param.dtype).reshape(param.to_local().shape)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    def __repr__(self) -> str:
        return (f"ReduceScatterReducer(world_size={self.world_size}, rank={self.rank}, "
                f"groups={len(set(self._group_of.values()))}, step_timeout={self.step_timeout})")


def _split(out: torch.Tensor, bucket) -> Dict[int, torch.Tensor]:
    """This rank's rows of each tensor of ``bucket`` from the reduce-scatter output."""
    result, offset = {}, 0
    for i, t, p in bucket:
        chunk, local, _ = shard_rows(p)
        width = t.numel() // (p.shape[0] if p.dim() > 0 else 1)
        result[i] = out[offset: offset + local * width]
        offset += chunk * width
    return result


def _device_of(tensors, params) -> torch.device:
    if tensors:
        return tensors[0].device
    return params[0].device if params else torch.device("cpu")

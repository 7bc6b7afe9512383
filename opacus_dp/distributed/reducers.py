"""Reducers: how the DP optimizer combines the clipped gradient sums of several processes.

The optimizer's reducer seam is ``reducer.world_size``, ``reducer.adds_noise`` and
``reducer.reduce(tensors)``. At each (non-virtual) step the optimizer adds the Gaussian
noise only where ``adds_noise`` is true, then calls ``reduce`` on the per-parameter sums,
then divides by ``expected_batch_size · world_size`` (mean reduction).

:class:`AllReduceReducer` puts the noise on rank 0 only: with per-rank clipped sums
``S_r`` and ``N ~ 𝒩(0, σ²C²I)`` drawn once,

    update = (N + Σ_r S_r) / (B_local · W) ,

so the averaged update carries noise of std ``σ·C / B_global`` exactly once (the same as
one process training on the union of the batches), and ``all_reduce`` hands every rank
the same bytes, so all ranks apply bit-identical updates.

Every step also checks that the ranks still agree on the settings the optimizer passes as
``agreed`` (σ, the clipping bounds, the number of batches merged into the step, ...), which a
scheduler or a branch on the rank may have changed on one rank after the setup check: rank
``r`` writes its values into row ``r`` of a ``(W, m)`` table of zeros appended to the bucket,
so the same all-reduce delivers every rank's values exactly (a sum with zeros), and a
disagreement raises the same error on every rank (no rank is left waiting in a collective).
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from opacus_dp.distributed.checks import require_process_group

NOISE_RANK = 0


class AllReduceReducer:
    """Sums tensors over the processes of ``process_group`` with one all-reduce per step.

    All tensors of one (dtype, device) are flattened into a single bucket, so a model with
    one parameter dtype costs exactly one ``all_reduce`` of ``Σ_p numel(p)`` elements.
    ``bytes_reduced`` and ``num_all_reduces`` count what this rank sent into collectives.
    """

    def __init__(self, *, process_group=None):
        require_process_group("AllReduceReducer")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.adds_noise = self.rank == NOISE_RANK
        self.bytes_reduced = 0
        self.num_all_reduces = 0

    @torch.no_grad()
    def reduce(self, tensors: List[torch.Tensor],
               agreed: Optional[Dict[str, float]] = None) -> List[torch.Tensor]:
        """Replace every tensor, in place, by its sum over all ranks; return ``tensors``;
        raise on every rank if the ranks disagree on ``agreed`` (module doc).

        Every rank must pass tensors of the same shapes in the same order (the same model).
        """
        names = sorted(agreed or {})
        for index, same_kind in enumerate(_grouped(tensors).values()):
            parts = [t.reshape(-1) for t in same_kind]
            if index == 0 and names:
                parts.append(self._agreement_rows([agreed[n] for n in names], same_kind[0]).reshape(-1))
            flat = torch.cat(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            self.bytes_reduced += flat.numel() * flat.element_size()
            self.num_all_reduces += 1
            offset = 0
            for t in same_kind:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            if index == 0 and names:
                _check_agreement(names, flat[offset:].view(self.world_size, len(names)))
        return tensors

    def _agreement_rows(self, values: List[float], like: torch.Tensor) -> torch.Tensor:
        rows = like.new_zeros(self.world_size, len(values))
        rows[self.rank] = torch.tensor(values, dtype=torch.float64).to(like.dtype)
        return rows

    def __repr__(self) -> str:
        return (
            f"AllReduceReducer(world_size={self.world_size}, rank={self.rank}, "
            f"adds_noise={self.adds_noise})"
        )


def _grouped(tensors: List[torch.Tensor]) -> Dict[Tuple, List[torch.Tensor]]:
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"AllReduceReducer.reduce expects tensors, got {type(t).__name__}")
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _check_agreement(names: List[str], table: torch.Tensor) -> None:
    """Raise if a column of ``table`` (one row per rank) is not constant."""
    for column, name in enumerate(names):
        values = table[:, column]
        if not bool((values == values[0]).all()):
            per_rank = {rank: float(v) for rank, v in enumerate(values.tolist())}
            raise ValueError(
                f"{name} differs between ranks at this step ({per_rank}): every process must use "
                "the same settings (step schedulers on every rank, not only on rank 0; run the same "
                "number of backward passes per step everywhere). Nothing was updated")


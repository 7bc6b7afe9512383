"""The train loader of a private Lightning run and its place in the Poisson sample stream.

``PrivateDataLoader(DataLoader(dataset, batch_size=B))`` yields Poisson batches once
:class:`~opacus_dp.integrations.lightning.DPCallback` has made it private: at each of its ``len``
steps per epoch every example is in the batch independently with probability ``q = 1/len``.

It follows Lightning's protocol of resumable loaders (``state_dict`` / ``load_state_dict``), so its
position travels in every checkpoint: ``k``, the batches of the current epoch already handed to
training, and the sampler generator's state when the epoch began (not in secure mode). Lightning
calls ``load_state_dict`` only when it resumes *inside* an epoch; the loader then sets the
generator back to the epoch's start and draws the epoch's first ``k`` batches again, dropping them
(their data is loaded, nothing is trained). The rest of the epoch gets the batches of the
uninterrupted run, whatever ``num_workers``: workers draw indices ahead of training, so the
generator's state when the checkpoint was written is not the position. In secure mode no generator
state is saved and the epoch's remaining ``len - k`` batches are fresh Poisson samples.
"""

from typing import Optional

import torch
from torch.utils.data import DataLoader

POSITION = "batches"  # batches of the current epoch handed to training
PER_EPOCH = "batches_per_epoch"
EPOCH_START = "epoch_start_generator_state"


class PrivateDataLoader:
    """The train loader of a private run: wraps ``data_loader`` (a map-style ``DataLoader``) and,
    once :class:`~opacus_dp.integrations.lightning.DPCallback` has made it private, iterates
    Poisson batches (module doc).

    ``len()`` is the number of steps per epoch, ``len(data_loader)``. It is deliberately not a
    ``DataLoader``, so Lightning leaves its sampler alone (no ``DistributedSampler`` is injected).
    ``position`` counts the batches of the current epoch handed out so far."""

    def __init__(self, data_loader: DataLoader):
        if not isinstance(data_loader, DataLoader):
            raise TypeError("PrivateDataLoader: data_loader must be a torch.utils.data.DataLoader over a "
                            f"map-style dataset, got {type(data_loader).__name__}")
        self.data_loader = data_loader
        self.private_loader: Optional[DataLoader] = None  # the Poisson loader, set by DPCallback
        self.position = 0
        self._keep_generator_states = False
        self._epoch_start: Optional[torch.Tensor] = None
        self._resume: Optional[dict] = None

    def use_private_loader(self, private_loader: DataLoader, *, keep_generator_states: bool) -> None:
        """Iterate ``private_loader`` (``make_private``'s) from now on; ``keep_generator_states``:
        save its generator's state in :meth:`state_dict` (False in secure mode)."""
        self.private_loader = private_loader
        self._keep_generator_states = bool(keep_generator_states)

    def __len__(self) -> int:
        return len(self.private_loader if self.private_loader is not None else self.data_loader)

    @property
    def dataset(self):
        return self.data_loader.dataset

    def __iter__(self):
        # a generator: Lightning may call iter() to check the loader; nothing is drawn until next()
        if self.private_loader is None:
            raise RuntimeError("PrivateDataLoader: training has not been made private; pass "
                               "Trainer(callbacks=[DPCallback(...)]) (opacus_dp.integrations.lightning)")
        replayed = self._start_epoch()
        # the batches trained on before the checkpoint: drawn again so the stream continues exactly
        for batch in self.private_loader.iter_after(replayed):  # make_private's DPDataLoader
            self.position += 1
            yield batch

    def _start_epoch(self) -> int:
        """Set the position at the start of a pass (the saved one when Lightning resumes inside an
        epoch); return how many batches to draw again and drop."""
        resume, self._resume = self._resume, None
        inside = resume is not None and 0 < resume[POSITION] < len(self)
        replay = inside and self._keep_generator_states and EPOCH_START in resume
        generator = self.private_loader.generator
        if replay:
            generator.set_state(resume[EPOCH_START])
        self._epoch_start = generator.get_state() if self._keep_generator_states else None
        self.position = resume[POSITION] if inside else 0
        return self.position if replay else 0

    # ------------------------------------------------------------------ Lightning's resumable-loader protocol
    def state_dict(self) -> dict:
        """The position saved in Lightning checkpoints (module doc)."""
        state = {POSITION: int(self.position), PER_EPOCH: len(self)}
        if self._epoch_start is not None:
            state[EPOCH_START] = self._epoch_start.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Keep the saved position (checked now) for the next pass; Lightning calls this when it
        resumes inside an epoch, before training starts."""
        if not isinstance(state, dict) or not isinstance(state.get(POSITION), int) \
                or not isinstance(state.get(PER_EPOCH), int) or not 0 <= state[POSITION] <= state[PER_EPOCH]:
            raise ValueError(f"PrivateDataLoader: the checkpoint's loader state is malformed ({state!r}); resume "
                             "from a checkpoint written by a Trainer with DPCallback")
        if state[PER_EPOCH] != len(self):
            raise ValueError(
                f"PrivateDataLoader: the checkpoint was written with {state[PER_EPOCH]} batches per epoch, this loader "
                f"has {len(self)}, so the sampling rate q = 1/len differs; resume with the same dataset and batch_size")
        start = state.get(EPOCH_START)
        if start is not None and not (torch.is_tensor(start) and start.dtype == torch.uint8):
            raise ValueError(f"PrivateDataLoader: {EPOCH_START} must be a torch.uint8 generator state, got "
                             f"{type(start).__name__}")
        self._resume = dict(state)

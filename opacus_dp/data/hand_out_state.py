"""The sampling state after the last batch a DP loader handed out to the training loop.

With worker processes a loader draws batches ahead of the loop (``prefetch_factor`` per worker),
so its sampling generator runs ahead of training. A checkpoint must save the state after the last
batch trained on, and a pass left early must leave the generator there, or a resumed run (or the
next pass) skips the batches drawn ahead. Samplers that set ``logs_draw_states`` append the
generator's state after each batch's draws to ``state_log`` (:func:`~opacus_dp.data.samplers.log_state_after_draw`);
the loader pops one state per batch it hands out.
"""

from collections import deque
from typing import Iterator, Optional

import torch


class HandOutState:
    """Mixin of the DP loaders (``self.generator``: the sampling generator, ``self.batch_sampler``,
    ``self.num_workers``)."""

    _state_at_hand_out: Optional[torch.Tensor] = None

    def _start_pass(self) -> Optional[deque]:
        """Undo the unused draws of a pass left early; with worker processes and a logging
        sampler, return the new pass's state log (else ``None``)."""
        if self._state_at_hand_out is not None:
            self.generator.set_state(self._state_at_hand_out)
            self._state_at_hand_out = None
        if self.num_workers > 0 and getattr(self.batch_sampler, "logs_draw_states", False) \
                and isinstance(self.generator, torch.Generator):
            self._state_at_hand_out = self.generator.get_state()
            self.batch_sampler.state_log = deque()
            return self.batch_sampler.state_log
        return None

    def _noting_states(self, batches: Iterator, log: deque) -> Iterator:
        """``batches``, keeping the sampling state after the last one handed out."""
        try:
            for batch in batches:
                if log:
                    self._state_at_hand_out = log.popleft()
                yield batch
            self._state_at_hand_out = None  # every draw of the pass was handed out
        finally:
            if getattr(self.batch_sampler, "state_log", None) is log:
                self.batch_sampler.state_log = None

    def sampling_state(self) -> torch.Tensor:
        """The sampling generator's state after the last batch handed out to the loop: what a
        checkpoint saves, so that a resumed run draws the batches after those trained on. With
        worker processes the generator runs ahead by the batches drawn in advance; a new pass
        starts from this state too (the draws of a pass left early are never used)."""
        state = self._state_at_hand_out
        return state if state is not None else self.generator.get_state()

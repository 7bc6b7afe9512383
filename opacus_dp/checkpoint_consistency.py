"""Cross-checks between a checkpoint's privacy history and the rest of its state.

A history shortened by hand (50 recorded steps replaced by one) would make ``get_epsilon``
under-report ε after resuming. The DP optimizer counts the steps it released (``steps_taken``,
saved as ``dp_optimizer_steps`` and restored on loading); that count can only be *at most* the
number of steps the history records — an accountant may also hold steps of other optimizers or
of earlier runs, never fewer. A file that contradicts this is refused. (The inner optimizer's
own counters, such as Adam's ``step``, are not compared: an optimizer warmed up without privacy
before ``make_private`` legitimately counts more steps than the history.)

What this proves: the history was not shortened *alone*. An editor who also lowers every counter
is not detected; only a signed checkpoint (``signing_key``) protects against that.
"""

from opacus_dp.checkpoint_file import CheckpointIntegrityError

STEPS_ENTRY = "dp_optimizer_steps"


def history_steps(accountant_state: dict) -> int:
    """Σ num_steps over the ``(σ, q, num_steps)`` records of an accountant's state dict."""
    return sum(int(entry[2]) for entry in accountant_state.get("history", []))


def check_history_agrees(path, state: dict) -> None:
    """Refuse ``state`` (a checkpoint dict) if a step counter exceeds its history's step count."""
    accountant_state = state.get("privacy_accountant_state_dict")
    if not isinstance(accountant_state, dict):
        return
    recorded = history_steps(accountant_state)
    count = state.get(STEPS_ENTRY)
    if isinstance(count, int) and count > recorded:
        raise CheckpointIntegrityError(
            f"checkpoint {path}: its privacy history records {recorded} steps, but the DP optimizer "
            f"took {count}: the history was edited or belongs to another run, and resuming would "
            "under-report epsilon; nothing was loaded. Use the checkpoint as it was written "
            "(sign checkpoints with signing_key= to detect any change)")

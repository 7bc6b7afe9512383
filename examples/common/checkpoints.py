"""Checkpoints that let ``--resume`` continue a private run where it stopped.

A checkpoint holds the model (without wrapper prefixes), the optimizer state, the complete
privacy history (so ε keeps growing from where it was, never restarts at 0), the sampler's
generator state, σ, and the example's own entries (epoch, best accuracy, ...).

* modern API: ``PrivacyEngine.save_checkpoint`` / ``load_checkpoint``;
* classic API: ``engine.state_dict()`` (steps and privacy history) next to model and optimizer;
* no privacy: model and optimizer only.

Files are read with torch's safe loader (``weights_only=True``): a checkpoint that holds a
pickled object which would run code is refused. ``--unsafe-resume`` reads an old file of your own
with the full unpickler instead.
"""

import os
import shutil
from typing import Optional

import torch

from opacus_dp.checkpoints import file_format
from opacus_dp.model_wrappers import unwrap_model as unwrap  # noqa: F401  (used by the examples)

from common.privacy import TrainingRun


def _load_kwargs(unsafe: bool) -> dict:
    return {"weights_only": not unsafe}


def read(path: str, unsafe: bool = False) -> dict:
    """The raw checkpoint dictionary (on CPU), e.g. to read σ before building the run; read
    safely unless ``unsafe`` (module doc)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--resume {path}: no such checkpoint file")
    try:
        return file_format.read(path, map_location="cpu", torch_load_kwargs=_load_kwargs(unsafe))
    except Exception as error:
        raise SystemExit(f"--resume {path}: {error}") from error


def saved_noise_multiplier(args, saved: dict, say) -> Optional[float]:
    """The checkpoint's σ, which a resumed run keeps (its privacy history continues with it).
    ``--sigma``/``--target-epsilon`` that ask for another σ are reported as not applied, and
    ``args`` is updated so that the metrics file records the σ actually used."""
    sigma = saved.get("noise_multiplier")
    if sigma is None or getattr(args, "disable_dp", False):
        return sigma
    if args.target_epsilon is not None or args.sigma != sigma:
        say(f"resuming with the checkpoint's noise multiplier σ = {sigma:.6g}: --sigma and "
            "--target-epsilon apply to new runs only (ε continues from the saved history)")
    args.sigma, args.target_epsilon = float(sigma), None
    return sigma


def save(run: TrainingRun, path: str, entries: dict, *, best: bool = False) -> None:
    """Write the checkpoint to ``path`` (and copy it to the best-checkpoint path if ``best``)."""
    entries = dict(entries, api=run.api, noise_multiplier=run.noise_multiplier,
                   privacy=run.privacy_summary())
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if run.api == "modern":
        run.engine.save_checkpoint(path=path, module=run.model, optimizer=run.optimizer,
                                   checkpoint_dict=entries)
    else:
        state = dict(entries, module_state_dict=unwrap(run.model).state_dict(),
                     optimizer_state_dict=run.optimizer.state_dict())
        if run.api == "classic":
            state["privacy_engine_state_dict"] = run.engine.state_dict()
            state["sampler_generator_state"] = run.train_loader.generator.get_state()
        file_format.write(state, path)
    if best:
        shutil.copyfile(path, best_path(path))


def best_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}_best{ext or '.pt'}"


def restore(run: TrainingRun, path: str, map_location: Optional[torch.device] = None,
            unsafe: bool = False) -> dict:
    """Load ``path`` into ``run``; return the example's own entries (epoch, ...)."""
    saved_api = read(path, unsafe).get("api")
    if saved_api != run.api:
        raise SystemExit(f"--resume {path}: the checkpoint was written with api={saved_api!r}, "
                         f"this run uses {run.api!r}; pass the same --api/--disable-dp flags")
    if run.api == "modern":
        return run.engine.load_checkpoint(path=path, module=run.model, optimizer=run.optimizer,
                                          map_location=map_location, torch_load_kwargs=_load_kwargs(unsafe))
    state = file_format.read(path, map_location=map_location, torch_load_kwargs=_load_kwargs(unsafe))
    unwrap(run.model).load_state_dict(state.pop("module_state_dict"))
    run.optimizer.load_state_dict(state.pop("optimizer_state_dict"))
    if run.api == "classic":
        run.engine.load_state_dict(state.pop("privacy_engine_state_dict"))
        run.train_loader.generator.set_state(state.pop("sampler_generator_state"))
    return state

"""What Opacus's import paths re-export, in modules named by concept.

The modules at Opacus's paths (``opacus_dp.optimizers``, ``opacus_dp.data_loader``,
``opacus_dp.utils.*``, ``opacus_dp.dp_model_inspector``, ...; docs/compatibility.md) only
re-export; the classes and functions that exist only for Opacus's API live here: Opacus's
optimizer class names (:mod:`~opacus_dp.compat.optimizer_names`), its collate wrappers
(:mod:`~opacus_dp.compat.collate`), 0.x's model inspector and statistics
(:mod:`~opacus_dp.compat.model_inspector`, :mod:`~opacus_dp.compat.stats`), ...

The package imports nothing itself, so that each part can be imported alone.
"""

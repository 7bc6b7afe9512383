"""The privacy engines and what they share.

* :mod:`~opacus_dp.engine.modern`: ``PrivacyEngine`` (Opacus 1.x: ``make_private``, ``get_epsilon``,
  checkpoints), which also dispatches ``PrivacyEngine(model, ...)`` to the classic engine;
* :mod:`~opacus_dp.engine.classic`: Opacus 0.x's ``attach`` engine, with its arguments
  (:mod:`~opacus_dp.engine.classic_arguments`) and the optimizer patching of ``attach``
  (:mod:`~opacus_dp.engine.classic_patching`);
* shared by both: argument checks (:mod:`~opacus_dp.engine.arguments`), the model's wrapper
  (:mod:`~opacus_dp.engine.model`), the :class:`~opacus_dp.optim.DPOptimizer`
  (:mod:`~opacus_dp.engine.optimizer`), the hooks of a private step (distributed reduction, budget
  guard, accountant: :mod:`~opacus_dp.engine.private_step`, :mod:`~opacus_dp.engine.budget_guard`).

The package imports nothing itself, so that each part can be imported alone; ``PrivacyEngine``
is imported from :mod:`opacus_dp`.
"""

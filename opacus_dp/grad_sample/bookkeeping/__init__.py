"""The norms-only modes (``ghost`` / ``bk``): per-sample gradient norms and the clipped sum
without materialised per-sample gradients.

* :mod:`.module`: :class:`~.module.BookkeepingGradSampleModule`, the wrapper of both modes;
* :mod:`.bookkeeper` and :mod:`.passes`: what one backward pass records per layer call, and
  how its norms and clipped sums are formed (ghost norms or materialised, per layer);
* :mod:`.norm_rules` and :mod:`.norm_samplers`: the per-layer rules, one
  :class:`~.norm_rules.NormRule` record per layer type;
* :mod:`.chunked_sums`, :mod:`.recomputed_inputs`, :mod:`.weight_grad_skipping`: memory and
  arithmetic savings of the ``bk`` mode;
* :mod:`.ghost_criterion`: the two-pass criterion of Opacus 1.6's ghost clipping.
"""

"""The forward pass of :class:`~opacus_dp.integrations.transformers.DPTrainer`'s training step.

The ``Trainer`` hands its training step the model as Accelerate prepared it: compiled
(``torch.compile(model)``) under ``TrainingArguments(torch_compile=True)``, its forward under
autocast with float32 outputs under ``bf16``/``fp16``. That does not suit private training:

* a compiled user model runs each hooked layer's per-sample hooks outside its graphs, a graph
  break per layer (slower than eager training where compiling speeds up the model);
* under DPDDP (several processes) Accelerate does not prepare the model at all, so neither
  compiling nor autocast would happen.

So the training step calls the private model (``make_private``'s), on one process and on several:

* compiled, when Accelerate's dynamo settings ask for it, as ``private.compile(**settings)``
  (the settings Accelerate passes to ``torch.compile``): the hooked layers are traced as taps in
  the model's graphs (``docs/compile.md``). Accelerate's regional compilation compiles blocks of
  the model, around which the hooks would run eagerly; here the whole model is compiled instead;
* under ``accelerator.autocast()``, outputs in float32 (what Accelerate's prepared forward does;
  on one process that forward runs inside it, the same autocast).

Evaluation is the ``Trainer``'s own (Accelerate's preparation, no per-sample work).
"""

from typing import Callable

import torch
from accelerate.utils import DynamoBackend, convert_to_fp32


def compile_as_accelerate_would(private: torch.nn.Module, accelerator) -> None:
    """``private.compile(...)`` with Accelerate's ``torch.compile`` settings, if it has any."""
    plugin = accelerator.state.dynamo_plugin
    if plugin is not None and plugin.backend != DynamoBackend.NO:
        private.compile(**plugin.to_kwargs())


def mixed_precision_forward(private: torch.nn.Module, accelerator) -> Callable:
    """``private(**inputs)`` under the ``Trainer``'s autocast, floating outputs in float32."""
    def forward(**inputs):
        with accelerator.autocast():
            return convert_to_fp32(private(**inputs))

    return forward

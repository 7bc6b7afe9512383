"""A CPU stand-in for ``nn.DataParallel`` that runs the same scatter → replicate →
parallel_apply → gather path on several CPU "devices".

On a machine without GPUs torch's ``DataParallel`` simply calls the wrapped module, and its
``Broadcast``/``Scatter`` functions need CUDA. :class:`CPUDataParallel` is an
``nn.DataParallel`` (so ``isinstance`` checks and ``DataParallel.forward`` are the real ones)
whose four device primitives are replaced by CPU equivalents with the same structure:

* ``replicate``: every module is copied with ``Module._replicate_for_data_parallel`` (shallow
  ``__dict__`` copy: hooks are shared with the master), replica parameters are non-leaf,
  differentiable copies of the masters (gradients flow back and are summed into the masters),
  parameters are set as plain attributes, buffers copied;
* ``parallel_apply``: one thread per replica, grad mode propagated, exceptions re-raised;
* ``scatter``/``gather``: ``torch.chunk``/``torch.cat`` along ``dim``.
"""

import threading
from typing import Any, Dict, List, Sequence

import torch
import torch.nn as nn


class _CopyToReplicas(torch.autograd.Function):
    """``num_replicas`` copies of each input; backward sums the copies' gradients."""

    @staticmethod
    def forward(ctx, num_replicas: int, *tensors: torch.Tensor):
        ctx.num_inputs = len(tensors)
        return tuple(t.clone() for _ in range(num_replicas) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n = ctx.num_inputs
        sums = []
        for i in range(n):
            parts = [g for g in grads[i::n] if g is not None]
            sums.append(torch.stack(parts).sum(0) if parts else None)
        return (None, *sums)


def _copies(tensors: List[torch.Tensor], num_replicas: int, detach: bool) -> List[List[torch.Tensor]]:
    """``copies[j][i]``: replica j's copy of ``tensors[i]`` (differentiable unless ``detach``)."""
    if not tensors:
        return [[] for _ in range(num_replicas)]
    if detach:
        flat = [t.detach().clone() for _ in range(num_replicas) for t in tensors]
    else:
        flat = list(_CopyToReplicas.apply(num_replicas, *tensors))
        flat = [c if t.requires_grad else c.detach() for c, t in zip(flat, tensors * num_replicas)]
    n = len(tensors)
    return [flat[j * n : (j + 1) * n] for j in range(num_replicas)]


def replicate_on_cpu(network: nn.Module, num_replicas: int, detach: bool = False) -> List[nn.Module]:
    """``num_replicas`` replicas of ``network`` built like ``torch.nn.parallel.replicate``."""
    params = list(network.parameters())
    param_copies = _copies(params, num_replicas, detach)
    param_index = {p: i for i, p in enumerate(params)}
    buffers = list(network.buffers())
    buffer_copies = _copies(buffers, num_replicas, detach=True)
    buffer_index = {b: i for i, b in enumerate(buffers)}
    modules = list(network.modules())
    module_index = {m: i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(num_replicas)]
    for j in range(num_replicas):
        for i, module in enumerate(modules):
            replica = copies[j][i]
            for key, child in module._modules.items():
                if child is None:
                    replica._modules[key] = None
                else:
                    setattr(replica, key, copies[j][module_index[child]])
            for key, param in module._parameters.items():
                value = None if param is None else param_copies[j][param_index[param]]
                setattr(replica, key, value)  # a plain attribute: replicas own no Parameters
            for key, buf in module._buffers.items():
                replica._buffers[key] = None if buf is None else buffer_copies[j][buffer_index[buf]]
    return [copies[j][0] for j in range(num_replicas)]


def parallel_apply_on_cpu(modules: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Sequence[Dict]):
    """``[modules[i](*inputs[i], **kwargs[i])]`` with one thread per module."""
    grad_enabled = torch.is_grad_enabled()
    results: Dict[int, Any] = {}
    lock = threading.Lock()

    def work(i):
        torch.set_grad_enabled(grad_enabled)
        try:
            args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
            output = modules[i](*args, **kwargs[i])
        except BaseException as e:  # re-raised in the calling thread
            output = e
        with lock:
            results[i] = output

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(modules)):
        if isinstance(results[i], BaseException):
            raise results[i]
    return [results[i] for i in range(len(modules))]


def _split(obj, num_chunks: int, dim: int):
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(num_chunks, dim=dim))
    if isinstance(obj, (list, tuple)) and obj:
        columns = [_split(o, num_chunks, dim) for o in obj]
        length = min(len(c) for c in columns)
        return [type(obj)(c[j] for c in columns) for j in range(length)]
    return [obj] * num_chunks


def _concat(outputs: List[Any], dim: int):
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=dim)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(parts), dim) for parts in zip(*outputs))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outputs], dim) for k in first}
    return first


class CPUDataParallel(nn.DataParallel):
    """``nn.DataParallel`` over ``num_replicas`` CPU replicas (see the module docstring)."""

    def __init__(self, module: nn.Module, num_replicas: int = 2, dim: int = 0):
        nn.Module.__init__(self)
        self.module = module
        self.dim = dim
        self.device_ids = list(range(num_replicas))
        self.output_device = 0
        self.src_device_obj = torch.device("cpu")

    def scatter(self, inputs, kwargs, device_ids):
        chunks = _split(tuple(inputs), len(device_ids), self.dim)
        kwargs = kwargs or {}
        kwarg_chunks = {k: _split(v, len(chunks), self.dim) for k, v in kwargs.items()}
        return tuple(chunks), tuple({k: v[j] for k, v in kwarg_chunks.items()} for j in range(len(chunks)))

    def replicate(self, module, device_ids):
        return replicate_on_cpu(module, len(device_ids), detach=not torch.is_grad_enabled())

    def parallel_apply(self, replicas, inputs, kwargs):
        return parallel_apply_on_cpu(replicas, inputs, kwargs)

    def gather(self, outputs, output_device):
        return _concat(list(outputs), self.dim)

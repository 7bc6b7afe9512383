"""The private PyTorch APIs of :mod:`opacus_dp.torch_internals`, one test each, checking the
behaviour the package relies on. A torch upgrade that breaks one fails here by name."""

import torch
import torch.nn as nn

from opacus_dp import torch_internals as internals


def test_torch_C_current_graph_task_id_is_shared_by_one_backward_pass():
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    z = y * 3
    y.register_hook(lambda g: seen.append(internals.current_graph_task_id()))
    z.register_hook(lambda g: seen.append(internals.current_graph_task_id()))
    z.sum().backward()
    (x * 5).sum().backward()
    assert len(seen) == 2 and seen[0] == seen[1] != -1
    assert internals.current_graph_task_id() == -1  # outside a backward pass


def test_execution_engine_queue_callback_runs_after_the_pass():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad):
        order.append("hook")
        internals.queue_end_of_backward_callback(lambda: order.append("end"))

    y.register_hook(hook)
    (y * 3).sum().backward()
    assert order == ["hook", "end"] and x.grad is not None


def test_top_saved_tensors_default_hooks_tell_checkpointing_apart():
    assert internals.saved_tensor_hooks_active() is False
    with torch.autograd.graph.save_on_cpu():
        assert internals.saved_tensor_hooks_active() is True


def test_saved_attributes_of_autograd_nodes():
    x = torch.randn(4, 6, requires_grad=True)
    y = nn.functional.leaky_relu(x, 0.2)
    assert torch.equal(internals.saved_value(y.grad_fn, "self"), x.detach())
    assert internals.saved_value(y.grad_fn, "negative_slope") == 0.2
    norm = nn.LayerNorm(6)
    out = norm(x)
    mean, rstd = internals.saved_value(out.grad_fn, "result1"), internals.saved_value(out.grad_fn, "result2")
    assert torch.allclose(mean.reshape(-1), x.detach().mean(1), atol=1e-6)
    assert torch.allclose(rstd.reshape(-1), 1 / torch.sqrt(x.detach().var(1, unbiased=False) + norm.eps), rtol=1e-5)


def test_storage_use_count_counts_the_tensors_sharing_storage():
    t = torch.zeros(5)
    alone = internals.storage_use_count(t)
    view = t[1:]
    assert internals.storage_use_count(t) == alone + 1
    del view
    assert internals.storage_use_count(t) == alone


def test_version_counter_is_shared_with_views_and_detached_aliases():
    t = torch.zeros(4)
    alias, view = t.detach(), t[:2]
    before = internals.version_counter(t)
    view.add_(1)
    assert internals.version_counter(t) == internals.version_counter(alias) == before + 1


def test_view_base():
    t = torch.zeros(2, 3)
    assert internals.view_base(t.reshape(6)) is t
    assert internals.view_base(t) is None


def test_stateless_reparametrize_module_swaps_and_restores_parameters():
    layer = nn.Linear(2, 1)
    own = layer.weight
    swapped = torch.zeros_like(own)
    with internals.reparametrized(layer, {"weight": swapped}):
        assert layer.weight is swapped
        assert torch.equal(layer(torch.ones(1, 2)).detach(), layer.bias.detach().view(1, 1))
    assert layer.weight is own and isinstance(layer.weight, nn.Parameter)


def test_global_module_hook_ids_name_every_global_hook():
    before = internals.global_module_hook_ids()
    handles = [nn.modules.module.register_module_forward_pre_hook(lambda m, a: None),
               nn.modules.module.register_module_forward_hook(lambda m, a, o: None),
               nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)]
    try:
        assert internals.global_module_hook_ids() == before | {h.id for h in handles}
    finally:
        for handle in handles:
            handle.remove()
    assert internals.global_module_hook_ids() == before


def test_optimized_module_tells_its_model_and_fullgraph():
    model = nn.Linear(2, 2)
    assert not internals.is_compiled_module(model) and internals.fullgraph_original(model) is None
    assert internals.fullgraph_original(torch.compile(model, backend="eager", fullgraph=True)) is model
    plain = torch.compile(model, backend="eager")
    assert internals.is_compiled_module(plain) and internals.fullgraph_original(plain) is None


def test_a_compiled_function_tells_its_fullgraph():
    model = nn.Linear(2, 2)
    model.compile(backend="eager", fullgraph=True)
    assert internals.compiled_fullgraph(model._compiled_call_impl) is True
    model.compile(backend="eager")
    assert internals.compiled_fullgraph(model._compiled_call_impl) is False
    assert internals.compiled_fullgraph(torch.compile(lambda x: x + 1, backend="eager", fullgraph=True)) is True
    assert internals.compiled_fullgraph(model.forward) is False and internals.compiled_fullgraph(len) is False


def test_dynamo_compiling_holds_for_the_whole_compilation_of_a_frame():
    """True in dynamo's backend (after tracing, before the guards are built), False outside."""
    seen = []

    def backend(graph_module, example_inputs):
        seen.append(internals.dynamo_compiling())
        return graph_module.forward

    assert not internals.dynamo_compiling()
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert seen == [True] and not internals.dynamo_compiling()

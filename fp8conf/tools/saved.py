"""What a training step keeps alive between its forward and its backward, measured on real
tensors, for ``torch.compile`` and for fp8conf's compiled joint graphs alike.

Both partition the step the same way in principle: the forward hands the backward a list of
saved values. Their sizes are counted once per distinct storage (a view saved beside its base
costs nothing more), and values sharing storage with the step's inputs (parameters, buffers,
the batch) are left out, since those live through the step anyway. What remains is the memory
the partition decided to keep, which, with the parameters and gradients, sets the step's peak.

``torch.compile``'s saved values are seen through ``torch.autograd.graph.saved_tensors_hooks``
(AOTAutograd saves them with ``ctx.save_for_backward``); fp8conf's are the forward graph's
outputs beyond the user outputs (:func:`fp8conf.compile_joint` keeps the two compiled graphs in
``CompiledJoint.artifact``).
"""

from __future__ import annotations

import dataclasses

import torch

from fp8conf.graph.trace import as_args, joint_signature

__all__ = ["SavedValues", "saved_by_compiled_joint", "saved_by_torch_compile"]


@dataclasses.dataclass(frozen=True)
class SavedValues:
    """Saved values of one step.

    Attributes:
        nbytes: bytes of the distinct storages saved, those of the step's inputs left out.
        storages: how many such storages.
        tensors: how many tensors were saved, inputs and aliases included.
    """

    nbytes: int
    storages: int
    tensors: int


def _count(saved, inputs) -> SavedValues:
    exclude = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    sizes = {}
    tensors = [t for t in saved if isinstance(t, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            sizes[storage.data_ptr()] = storage.nbytes()
    return SavedValues(sum(sizes.values()), len(sizes), len(tensors))


def _step_inputs(model, args) -> list:
    return list(model.parameters()) + list(model.buffers()) + list(as_args(args))


def saved_by_torch_compile(compiled_model, model: torch.nn.Module, args) -> SavedValues:
    """What ``compiled_model`` (``torch.compile(model)``, already run once so that it is compiled)
    saves for the backward of ``compiled_model(*args)``."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = compiled_model(*as_args(args))
    del out  # its graph, and with it what the hooks hold, dies with the returned counts
    return _count(saved, _step_inputs(model, args))


def saved_by_compiled_joint(gm: torch.fx.GraphModule, compiled, model: torch.nn.Module, args) -> SavedValues:
    """What :func:`fp8conf.compile_joint`'s result ``compiled`` (of joint graph ``gm``,
    partitioned) saves for the backward of ``model(*args)``: its forward's outputs beyond the
    user outputs."""
    if not isinstance(compiled.artifact, tuple) or len(compiled.artifact) != 2:
        raise ValueError("saved_by_compiled_joint needs a partitioned compile: compile_joint(gm, partition=True) of a joint graph")
    signature = joint_signature(gm)
    forward = compiled.artifact[0]
    example_grads = [None] * sum(spec.is_tangent for spec in signature.inputs)
    primals, _ = signature.feed(model, args, example_grads)
    with torch.no_grad():
        out = list(forward(*primals))
    num_user_outputs = len(signature.outputs) - signature.num_primals
    return _count(out[num_user_outputs:], primals)

"""A conformance backend for a trainer that owns its float8 linears: the worked example.

The trainer's modules are :class:`trainer_float8.TrainerFloat8Linear` (recipes ``rowwise`` and
``rowwise_with_gw_hp``, no tensorwise; an emulated mode; forward on ``F.scaled_mm``, backward on
``torch._scaled_mm``) and :class:`trainer_mx.TrainerMXLinear` (MXFP8 on ``F.scaled_mm`` with
swizzled e8m0 scales, no emulated mode). The trainer runs fp8conf's passes on its graphs, so the
adapter is short:

* it claims ``float8_modules`` and declares the recipes its linears have
  (``float8_recipes``); the suite then builds every float8 layer it draws through
  :meth:`TrainerBackend.convert_float8`, never draws a tensorwise layer, and reports a property
  that asks only for tensorwise as ``not_supported``;
* the module is declared to fp8conf from outside (``fp8conf.register_quantized_module``, in
  ``own_module_walkthrough.py``), as the trainer's own code cannot import fp8conf;
* its provenance maps the trainer's kind onto the contract's neutral ``float8_linear``;
* it claims ``mx`` and declares the one MX recipe its MX linears have
  (``mx_recipes = {"mxfp8_swizzled"}``): the suite draws them through :meth:`TrainerBackend.convert_mx`
  and judges their layout (MXS), and reports the properties about other MX recipes as
  ``not_supported``; the module is declared to fp8conf here (:func:`describe_mx`);
* it claims ``distributed`` and declares that its data-parallel steps gather weights in high
  precision and quantize after the gather (``weight_gathers = {"high_precision"}``): fp8conf's
  sharding gathers a module it does not know as TorchAO's in its own dtype, and the trainer's
  linear quantizes the gathered weight in its forward; the suite shards its own linears (DP-002,
  DP-003, DP-005) and does not ask for float8 all-gather (DP-001 is ``not_supported``);
* it claims ``rewrites``: the trainer's post-trace passes fuse a weight used twice's summed
  FP8 weight gradients into one scaled add-matmul, its own op (:func:`fuse_weight_grad_accumulation`,
  ``trainer_ops.scaled_addmm``, declared in :meth:`TrainerBackend.fp8_compute_ops` through
  ``fp8conf.register_compute_op``), then move the backward's remaining ``torch._scaled_mm``
  calls onto the second scaled-matmul API (:func:`to_second_api`); every property runs on the
  rewritten graph, and the RWR properties compare it with the graph as traced.

Run the suite against it from the repository root::

    PYTHONPATH=docs/examples pytest --fp8-backend=trainer_backend:TrainerBackend
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import trainer_float8  # noqa: E402
import trainer_mx  # noqa: E402
import trainer_ops  # noqa: E402

import fp8conf  # noqa: E402
from conformance.api import Provenance  # noqa: E402
from conformance.backends.reference import ReferenceBackend  # noqa: E402
from own_module_walkthrough import describe  # noqa: E402,F401  (declares the module to fp8conf, from outside)

__all__ = ["TrainerBackend", "to_second_api", "fuse_weight_grad_accumulation", "fuse_accumulations"]

#: The kinds fp8conf's provenance names the trainer's modules by (the walkthrough's declaration,
#: and :func:`describe_mx`), and the contract's neutral kinds they stand for.
TRAINER_KIND = "trainer_float8_linear"
TRAINER_MX_KIND = "trainer_mx_linear"
_NEUTRAL_KINDS = {TRAINER_KIND: "float8_linear", TRAINER_MX_KIND: "mxfp8_linear"}


def describe_mx(module: trainer_mx.TrainerMXLinear) -> fp8conf.QuantizationConfig:
    """The trainer's MX linear, declared to fp8conf from outside: real MXFP8 compute in all three
    matmuls."""
    return fp8conf.QuantizationConfig(kind=TRAINER_MX_KIND, recipe=module.recipe, emulate=False)


fp8conf.register_quantized_module("trainer_mx.TrainerMXLinear", describe_mx)
# The trainer's fused kernel is FP8 compute: its operands at 1 and 2, its scales at 3 and 4.
fp8conf.register_compute_op(torch.ops.trainer_example.scaled_addmm, operands=(1, 2),
                            scales=((3, "scale_a"), (4, "scale_b")))
_SCALED_MM = torch.ops.aten._scaled_mm.default


def fuse_weight_grad_accumulation(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every parameter gradient the graph returns as ``add(acc, scaled_mm(a, b,
    scale_a, scale_b))`` (a weight used twice: its two FP8 weight gradients summed), the matmul
    computed after ``acc`` and used by the sum alone, into ``trainer_example::scaled_addmm(acc, a,
    b, scale_a, scale_b)``. The new node takes the matmul's metadata (provenance, pass, sequence
    number). The later matmul is the one fused: the fused node then follows the accumulator it
    reads, and its module call's region stays convex."""
    return fuse_accumulations(gm, lambda earlier, later: (earlier, later))


def fuse_accumulations(gm: torch.fx.GraphModule, pick) -> torch.fx.GraphModule:
    """:func:`fuse_weight_grad_accumulation` with ``pick(earlier, later)`` choosing, of the two
    summands in graph order, ``(acc, matmul)``."""
    signature = fp8conf.joint_signature(gm)
    output = gm.graph.find_nodes(op="output")[0]
    flat = list(output.args[0])
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for i, described in enumerate(signature.outputs):
        total = flat[i]
        if described is None or described.kind != "param_grad" or total is None or total.target != torch.ops.aten.add.Tensor:
            continue
        acc, matmul = pick(*sorted(total.args[:2], key=lambda n: order.get(n, -1)))
        if getattr(matmul, "target", None) is not _SCALED_MM or len(matmul.users) != 1:
            continue
        a, b, scale_a, scale_b, *rest = matmul.args
        bias, scale_result, out_dtype = (rest + [None] * 3)[:3]
        out_dtype = matmul.kwargs.get("out_dtype", out_dtype)
        if bias is not None or scale_result is not None or out_dtype != acc.meta["val"].dtype:
            continue
        with gm.graph.inserting_before(total):
            fused = gm.graph.call_function(torch.ops.trainer_example.scaled_addmm.default, (acc, a, b, scale_a, scale_b))
        fused.meta.update(matmul.meta)
        fused.meta["val"] = total.meta["val"]
        total.replace_all_uses_with(fused)
        gm.graph.erase_node(total)
        gm.graph.erase_node(matmul)
    gm.graph.lint()
    gm.recompile()
    return gm


#: ``ScalingType`` and the empty swizzle list as ``aten._scaled_mm_v2`` takes them.
_TENSORWISE, _ROWWISE = 0, 1


def to_second_api(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every ``aten._scaled_mm`` call with tensorwise or rowwise scales into
    the ``aten._scaled_mm_v2`` call ``F.scaled_mm`` makes: the same operands, scales and output
    dtype, each scale's scaling named from its shape. Node metadata moves to the new node
    (provenance, the pass the node belongs to, its autograd sequence number)."""
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten._scaled_mm.default)):
        a, b, scale_a, scale_b, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        out_dtype = rest[2] if len(rest) > 2 else node.kwargs.get("out_dtype")
        scaling = [_TENSORWISE if s.meta["val"].numel() == 1 else _ROWWISE for s in (scale_a, scale_b)]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.aten._scaled_mm_v2.default,
                (a, b, [scale_a], [scaling[0]], [], [scale_b], [scaling[1]], [], bias, out_dtype),
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


class TrainerBackend(ReferenceBackend):
    name = "trainer-example"
    capabilities = frozenset(
        {
            "provenance", "validation", "emulation", "regions", "compile.full", "compile.regional", "graphpp",
            "fingerprint", "artifacts", "float8_modules", "rewrites", "mx", "distributed",
        }
    )
    #: Its data-parallel steps gather weights in high precision and quantize after the gather.
    weight_gathers = frozenset({"high_precision"})
    float8_recipes = frozenset(trainer_float8.RECIPES)
    float8_emulation = True
    mx_recipes = frozenset({trainer_mx.TrainerMXLinear.recipe})

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        trainer_float8.convert(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)

    def convert_mx(self, model, *, module_filter_fn, recipe):
        trainer_mx.convert(model, module_filter_fn=module_filter_fn)

    def rewrite(self, gm):
        return to_second_api(fuse_weight_grad_accumulation(gm))

    def provenance(self, node):
        found = super().provenance(node)
        if found is None or found.kind not in _NEUTRAL_KINDS:
            return found
        return Provenance(found.module_fqn, _NEUTRAL_KINDS[found.kind], found.recipe, found.emulate)

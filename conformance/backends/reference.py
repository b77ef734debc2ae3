"""The ``reference`` backend: fp8conf's own passes behind the conformance adapter."""

from __future__ import annotations

import functools

import fp8conf
from conformance.api.backend import Backend
from conformance.api.types import Compiled, Provenance, Region, StageSplit
from fp8conf.quantized.grouped import has_scaled_grouped_mm_v2
from fp8conf.quantized.nvfp4 import has_nvfp4
from fp8conf.quantized.scaled_mm import has_scaled_mm_v2

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    name = "reference"
    version = fp8conf.__version__
    # ``scaled_mm_v2``, ``scaled_grouped_mm_v2`` and ``nvfp4`` where this torch has F.scaled_mm,
    # F.scaled_grouped_mm and float4_e2m1fn_x2 (2.12 and newer). ``float8_modules``: fp8conf's float8 linears are
    # TorchAO's, built through convert_float8 with each recipe's own config; being exactly TorchAO's, the suite
    # still builds those whose config it changes (FPR's config fields, DP's float8 all-gather) with TorchAO.
    capabilities = frozenset(
        {
            "provenance", "validation", "emulation", "regions", "compile.full", "compile.regional", "cudagraph", "graphpp",
            "fingerprint", "artifacts", "e8m0", "mx", "moe", "distributed", "float8_modules", "rewrites",
        }
        | ({"scaled_mm_v2"} if has_scaled_mm_v2() else set())
        | ({"scaled_grouped_mm_v2"} if has_scaled_grouped_mm_v2() else set())
        | ({"nvfp4"} if has_nvfp4() else set())
    )
    #: fp8conf's MXLinear has all three MX recipes; the swizzled one needs F.scaled_mm.
    mx_recipes = frozenset({"mxfp8", "mxfp8_emulated"} | ({"mxfp8_swizzled"} if has_scaled_mm_v2() else set()))

    def trace_joint(self, model, args):
        return fp8conf.trace_joint(model, args)

    def run_joint(self, gm, model, args, grad_outputs, *, fn=None):
        return fp8conf.run_joint(gm, model, args, grad_outputs, fn=fn)

    def provenance(self, node):
        found = fp8conf.get_provenance(node)
        if found is None:
            return None
        return Provenance(found.module_fqn, found.kind, found.recipe, found.emulate)

    def is_backward(self, node):
        tag = node.meta.get("partitioner_tag")
        if tag is not None:
            return tag == "is_backward"
        return fp8conf.node_passes(node.graph)[node] == "backward"

    def rewrite(self, gm):
        # What fp8conf runs on a joint graph before it cuts it (fp8conf.compile.partition): each
        # backward FP8 region's repeats of its forward's amaxes and scales merged, the region kept
        # whole; then what no output needs and no side effect keeps is removed.
        from fp8conf.compile.share_scales import share_forward_scales

        share_forward_scales(gm)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    def validate(self, gm, *, strict):
        # fp8conf's report is the contract's ValidationReport.
        return fp8conf.validate_fp8_graph(gm, strict=strict)

    def regions(self, gm):
        found = fp8conf.tag_fp8_regions(gm, strict=False)
        return [Region(r.id, r.nodes, r.complete, r.complete) for r in found]

    def split_stage(self, gm, *, strict=True):
        from fp8conf import split_stage

        split = split_stage(gm, strict=strict)
        return StageSplit(
            split.forward,
            split.backward_input,
            split.backward_weight,
            split.num_outputs,
            split.saved_for_input,
            split.saved_for_weight,
            split.input_grads,
            split.param_grads,
            split.output_layout,
        )

    def quantization_signature(self, model, *, strict=True):
        return fp8conf.QuantizationSignature.from_model(model, strict=strict).to_json()

    def fingerprint(self, model, *, strict=True):
        return fp8conf.QuantizationSignature.from_model(model, strict=strict).sha256

    @functools.cached_property
    def artifact_key(self) -> bytes:
        """The key this backend signs and verifies its artifacts with: its own, made per
        instance, so that the suite's runs depend on no user's key."""
        import secrets

        return secrets.token_bytes(32)

    def save_artifact(self, path, model, args, *, strict=True):
        fp8conf.precompile_model(path, model, args, strict=strict, key=self.artifact_key)

    def load_artifact(self, path, model, *, strict=True):
        compiled = fp8conf.load_for_model(path, model, strict=strict, key=self.artifact_key)
        return lambda args, grad_outputs: compiled.run(model, args, grad_outputs)

    def compile(self, gm, *, mode, cudagraph=False):
        # The contract's regional mode compiles exactly the tagged regions (NUM-003): the rest of
        # the graph stays eager, not cut into compiled pieces of its own.
        compiled = fp8conf.compile_joint(gm, mode=mode, strict=True, cudagraph=cudagraph, remainder="eager")
        return Compiled(compiled, compiled.compiled_nodes, compiled.eager_nodes)

    def fp8_compute_ops(self):
        # torch's scaled matmuls, and every op a trainer declared to fp8conf's passes: what those
        # passes count, in this process (an adapter built on the reference that registers its
        # kernel with fp8conf.register_compute_op has it declared here too).
        from conformance.api.types import TORCH_COMPUTE_OPS, ComputeOp
        from fp8conf.graph.roles import registered_compute_ops

        return TORCH_COMPUTE_OPS + tuple(ComputeOp(op, operands, scales) for op, operands, scales in registered_compute_ops())

    def convert_float8(self, model, *, module_filter_fn, recipe, emulate):
        # fp8conf quantizes TorchAO's Float8Linear: the recipe's own config, emulated or not.
        import dataclasses

        import torch
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        # A converted linear (an nn.Linear subclass) is left alone: the suite converts a nested one inside it.
        accepted = lambda module, fqn: type(module) is torch.nn.Linear and module_filter_fn(module, fqn)  # noqa: E731
        convert_to_float8_training(model, config=config, module_filter_fn=accepted)

    def convert_mx(self, model, *, module_filter_fn, recipe):
        from fp8conf import convert_to_mx_training

        convert_to_mx_training(model, recipe=recipe, module_filter_fn=module_filter_fn)

    def convert_scaled_mm(self, model, *, module_filter_fn, recipe):
        from fp8conf import convert_to_scaled_mm_training

        convert_to_scaled_mm_training(model, recipe=recipe, module_filter_fn=module_filter_fn)

    def convert_nvfp4(self, model, *, module_filter_fn, recipe):
        from fp8conf import convert_to_nvfp4_training

        convert_to_nvfp4_training(model, recipe=recipe, module_filter_fn=module_filter_fn)

    def convert_grouped_experts(self, model, *, module_filter_fn, recipe, emulate):
        from fp8conf import convert_to_float8_grouped_experts

        convert_to_float8_grouped_experts(model, recipe=recipe, emulate=emulate, module_filter_fn=module_filter_fn)

    def convert_scaled_grouped_experts(self, model, *, module_filter_fn, recipe):
        from fp8conf import convert_to_float8_grouped_experts

        convert_to_float8_grouped_experts(model, recipe=recipe, module_filter_fn=module_filter_fn, v2=True)

    def shard_data_parallel(self, model, mesh, *, float8_all_gather):
        from fp8conf.parallel import shard_data_parallel

        return shard_data_parallel(model, mesh, float8_all_gather=float8_all_gather)

    def shard_tensor_parallel(self, model, mesh, *, plan):
        from fp8conf.parallel import shard_tensor_parallel

        return shard_tensor_parallel(model, mesh, plan)

    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        from fp8conf.quantized.ops.e8m0 import scaled_mm_e8m0

        return scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)

    def e8m0_op(self):
        import torch

        import fp8conf.quantized.ops  # noqa: F401  (registers the op)

        return torch.ops.fp8conf.scaled_mm_e8m0.default

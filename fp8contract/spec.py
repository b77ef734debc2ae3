"""The registry of spec properties: the single source of IDs, levels and capabilities.

Each title is its rule's text in ``conformance/SPEC.md``'s property table, word for word, so a
failure message quotes the rule a backend is held to (the project's tests check they agree).

Tests cite a property with ``@pytest.mark.fp8_property("PROV-003")``; the plugin skips it as
``not_supported`` when the backend does not claim its capability, and the project's own tests
check that every cited ID exists here and every MUST property has a test.
"""

from __future__ import annotations

import dataclasses

__all__ = ["SPEC_VERSION", "Property", "PROPERTIES", "get_property", "relied_on"]

#: 1.1: PROV-002 checks the recipe only where the backend records one; BND-001 also runs a
#: backend's own split runner; FPR-004 moves to capability ``artifacts``; FPR-006, BND-007 and
#: the MOE area (FP8 grouped experts, capability ``moe``) are new; REG-002, REG-005,
#: NUM-001/002 and FPR-001 say more (see SPEC.md).
#: 1.2: the FPR rules hold a fingerprint to what its declared scope promises
#: (``Backend.fingerprint_scope``); config-field changes are drawn from what the backend's jobs
#: can express (``Backend.expressible_config_fields``) and an inexpressible one refused
#: (``UnsupportedConfig``) is not_supported; versions change in package metadata too;
#: VAL-007 and MOE-002 count the FP8 compute that runs (a grad_input kept for an in-place op too).
#: 1.3: NUM-005 (compiled MX matmuls receive the eager e8m0 scales).
#: Also 1.3 (sharded FP8): the DP area, capability ``distributed`` (``Backend.shard_data_parallel``,
#: ``Backend.shard_tensor_parallel``): what each weight all-gather moves with float8 all-gather on
#: and off, the data-parallel step's gradients against the unsharded step's, and FP8 compute kept
#: on every rank of a tensor-parallel linear.
#: Also 1.3: capability ``scaled_mm_v2`` (``Backend.convert_scaled_mm``): PROV, VAL, REG, BND, EMU-002
#: and NUM-001/002 draw linears on ``F.scaled_mm`` for a backend that claims it.
#: Also 1.3: capability ``scaled_grouped_mm_v2`` (``Backend.convert_scaled_grouped_experts``):
#: MOE-001..005 draw experts on ``F.scaled_grouped_mm`` for a backend that claims it, MOE-006..008
#: run each model on both grouped APIs where the device runs the second.
#: 1.4: E8M0-006 (`float8_e8m0fnu` scales are refused or read as the same bytes, compiled too
#: where Inductor compiles e8m0); E8M0-005 no longer asks that they be refused.
#: 1.5: capability ``float8_modules`` (``Backend.convert_float8``, ``Backend.float8_recipes``,
#: ``Backend.float8_emulation``): every area but DP builds its float8 layers through the backend
#: that claims it, of the recipes it declares; backward nodes pair with the first forward op of
#: their sequence number. EMU-004 (no silent fallback: a real FP8 step holds its recipes' FP8 compute
#: by the suite's count and is neither bit-identical to nor far from the high-precision step).
#: VAL-008 and ``Backend.fp8_compute_ops`` (the FP8 compute ops a backend declares, its own
#: custom ops included, checked against the low-precision compute the suite finds by dtypes).
#: The RWR area, capability ``rewrites`` (``Backend.rewrite``): every property runs on the
#: rewritten graph, and RWR-001..004 compare it with the graph as traced.
#: The NVF area, capability ``nvfp4`` (``Backend.convert_nvfp4``): PROV, VAL, REG, BND, EMU-002
#: and RWR draw NVFP4 layers; NVF-001 (their two-level block layout at every matmul, split
#: too) and NVF-002 (what the step computes, read by the suite where no kernel runs it).
#: The MXS area, capability ``mx`` with recipe ``mxfp8_swizzled`` declared in
#: ``Backend.mx_recipes``: MX linears on ``F.scaled_mm`` with swizzled e8m0 scales, drawn by the
#: same areas; MXS-001 (their layout traced, split and compiled) and MXS-002 (what they compute).
#: ``Backend.weight_gathers`` (``float8``, ``high_precision``) says how a backend's data-parallel
#: steps move quantized weights; DP-005 (quantize after gather: cast and scale from the gathered
#: weight); a backend that claims ``float8_modules`` is sharded with its own float8 linears in
#: DP-001, DP-002, DP-003 and DP-005.
#: 1.6: FP8 compute counts when its result reaches an output of its graph; a backend may remove
#: dead FP8 compute anywhere, and a graph or callable that still runs some fails VAL-007 or
#: BND-002 (save a grad_input nobody needs, kept for an in-place op); VAL-007's duplicate reaches
#: the outputs; BND-002, BND-003, BND-005 and MOE-002 say what they count. FPR-001 and FPR-005
#: draw grouped experts of both grouped APIs for a backend that claims ``moe``. EMU-005 holds MX
#: and NVFP4 linears to their recipes' definitions too, and EMU-006 (new) grouped experts of
#: either API; where the device has no kernel, the suite computes their matmuls.
SPEC_VERSION = "1.6"


@dataclasses.dataclass(frozen=True)
class Property:
    id: str
    level: str  # "MUST" or "SHOULD"
    capability: str
    since: str
    title: str
    #: Properties this one cannot hold without: their checks read what those guarantee (a
    #: validator counts FP8 compute by its provenance). When one of them fails too, this
    #: property's failure is reported as its consequence where the examples show it (both fail on
    #: some model, this one on none the other passes; ``conformance.plugin.causes``), and as a
    #: defect of its own otherwise.
    relies_on: tuple[str, ...] = ()


# Everything that attributes nodes to modules reads provenance; PROV-003's message names the
# backward pass, where a provenance defect shows first, so PROV-001/-006 defer to it.
_PROVENANCE = ("PROV-001", "PROV-002", "PROV-003", "PROV-004", "PROV-006")
_RELIES_ON = {
    "PROV-001": ("PROV-003",),
    "PROV-006": ("PROV-003",),
    **{
        f"{area}-{number:03d}": _PROVENANCE
        for area, count in (("VAL", 7), ("EMU", 3), ("REG", 7), ("BND", 6))
        for number in range(1, count + 1)
    },
    # The MoE rules that attribute nodes to experts modules read their provenance (MOE-001).
    **{f"MOE-{number:03d}": ("MOE-001",) for number in (2, 3, 4, 5)},
}


def _p(id: str, level: str, capability: str, title: str, since: str = "1.0") -> Property:
    return Property(id, level, capability, since, title, _RELIES_ON.get(id, ()))


_ALL = [
    _p("PROV-001", "MUST", "provenance", "Every FP8 compute node, forward and backward, carries provenance naming the module that issued it."),
    _p("PROV-002", "MUST", "provenance", "Provenance kind, recipe and emulate equal that module's config; for a backend that records no recipe (`provenance_has_recipe = False`) kind and emulate, and the report row notes that the recipe was not checked; a recipe such a backend gives all the same must equal the module's."),
    _p("PROV-003", "MUST", "provenance", "A backward node carries the provenance of the forward op it differentiates; gradient accumulation carries none. Backward nodes keep `seq_nr`. Every node that the gradients of the step's outputs reach, from the placeholders `run_joint` feeds them to, is backward by `is_backward`."),
    _p("PROV-004", "MUST", "provenance", "A forward node carries provenance only of the module that issued it; nodes of unquantized modules carry none."),
    _p("PROV-005", "SHOULD", "provenance", "Provenance survives common rewrites (CSE, DCE) unchanged."),
    _p("PROV-006", "MUST", "provenance", "A module called twice attributes both calls to its FQN; nested quantized modules attribute to the innermost."),
    _p("VAL-001", "MUST", "validation", "Strict validation accepts every graph the backend makes from a drawn model."),
    _p("VAL-002", "MUST", "validation", "When all FP8 compute of a non-emulated module in a pass is lowered to high precision, strict validation fails with an error whose message and `module_fqn` / `pass_name` name the module and the pass."),
    _p("VAL-003", "MUST", "validation", "FP8 compute without provenance fails strict validation, naming the node."),
    _p("VAL-004", "MUST", "validation", "A scaled op fed a high-precision matrix operand is not counted as FP8 compute: the non-strict report's count for that module and pass drops by one and strict validation fails."),
    _p("VAL-005", "MUST", "validation", "Validation, strict or not, changes neither the graph's code nor any node's or the graph module's meta."),
    _p("VAL-006", "SHOULD", "validation", "Non-strict validation reports the finding strict mode raises, warns once per finding and gives a summary that states the number of findings and names the module the suite broke and every module a finding names."),
    _p("VAL-007", "MUST", "validation", "The report's FP8 compute counts per `(module, pass)` are those the outputs need: the recipe's, to which a grad_input matmul the step does not need that the graph keeps for an in-place op may be added; the graph runs no other FP8 compute that no output needs; a duplicated compute node whose result reaches the outputs fails strict validation naming its module."),
    _p("VAL-008", "MUST", "validation", "Low-precision compute is the compute the backend declares: every op of the traced step that takes two or more FP8 or packed FP4 tensors and returns a high-precision floating tensor is one of the ops `Backend.fp8_compute_ops` declares (torch's scaled matmuls by default), and every call of a declared op takes low-precision tensors at its declared operand positions.", since="1.5"),
    _p("EMU-001", "MUST", "emulation", "An all-emulated model issues no FP8 compute and passes strict validation."),
    _p("EMU-002", "MUST", "emulation", "Next to an emulated module, a non-emulated module that lost its FP8 compute still fails strict validation, named."),
    _p("EMU-003", "SHOULD", "emulation", "One quantized layer, emulated and real, agree in output and gradients: relative norm of the difference at most 1e-5 (tensorwise) or 3e-2 (rowwise recipes) on CPU; on CUDA 1e-4 (tensorwise) or 3e-2."),
    _p("EMU-004", "MUST", "emulation", "On a model whose quantized modules are all real, the step is no silent high-precision step: every module issues its recipe's FP8 compute by the suite's own count; the step's output and gradients are not all bit-identical to the same weights' high-precision step (the quantized linears plain), nor is the weight gradient of a module that computes it in FP8; and each is closer to it than zero is (relative norm of the difference below 1).", since="1.5"),
    _p("EMU-005", "MUST", "emulation", "Each real quantized linear of a recipe the suite reads (`float8_linear`: tensorwise, rowwise, rowwise_with_gw_hp; `float8_scaled_mm_linear`: tensorwise, rowwise; `mxfp8_linear`: mxfp8, mxfp8_swizzled; `nvfp4_linear`: nvfp4), run eagerly in the backend's own model (its NVFP4 and swizzled MX matmuls computed by the suite's reading of the declared layout where the device has no kernel), computes what its recipe defines: on its own input and output gradient, its output, input gradient and weight gradient (summed over its calls) differ from the suite's reading of the recipe (each matmul's operands quantized in plain torch, by the recipe's dtype and scaling: per tensor, per row or per block along the contraction dim, and multiplied in float64) by at most 2.5 times the recipe's own rounding there (the relative norm of the definition's difference from the high-precision product) plus 0.01, in relative norm.", since="1.5"),
    _p("EMU-006", "MUST", "moe", "Each real experts module of a drawn MoE model (`float8_grouped_experts`, recipe rowwise, on either grouped API), run eagerly in the backend's own model (its grouped GEMMs computed by the suite's reading where the device has no kernel), computes what its recipe defines: on its own input, token groups and output gradient, its output, input gradient and weight gradient differ from the suite's reading (per token group, the rowwise recipe's three matmuls on the group's tokens and its expert's weight, operands quantized in plain torch and multiplied in float64) by at most 2.5 times the recipe's own rounding there plus 0.01, in relative norm.", since="1.6"),
    _p("REG-001", "MUST", "regions", "Every FP8 compute node lies in exactly one of the regions the backend reports."),
    _p("REG-002", "MUST", "regions", "All call_function nodes of a region were issued by one quantized module (the suite's own ground truth) in one call and one pass; nodes tagged with one region id come from one module call in one pass: the forward and backward regions of a call, and the two calls of a reused module, never share an id."),
    _p("REG-003", "MUST", "regions", "A region is convex: no path from a region node through nodes outside it comes back into it."),
    _p("REG-004", "MUST", "regions", 'Tagged nodes carry a region id (`compile_with_inductor["inductor_region"]`), every tagged group is complete by the suite\'s own check (its FP8 values and scales are made inside it or enter from a placeholder or the other pass), every reported region\'s `complete` equals that check of its nodes, and a region is tagged exactly when reported complete and tagged.'),
    _p("REG-005", "MUST", "regions", "After the suite rebuilds without metadata a cast to FP8 of a region, or that cast's whole quantization chain (amax, scale and cast), no compute node depending on that cast is tagged, and every tagged group stays complete."),
    _p("REG-006", "MUST", "regions", "Identifying twice gives the same regions; renaming every node changes neither ids, members (by position) nor tags."),
    _p("REG-007", "MUST", "regions", 'Annotations already in `node.meta["custom"]` survive tagging unchanged, and so do the options of a `compile_with_inductor` value a node already carries: tagging may add its region id to them, never drop or change one. Annotations a model makes while traced (`torch.fx.traceback.annotate`) reach every forward node its quantized modules issue inside them, and survive tagging too.'),
    _p("NUM-001", "MUST", "compile.full", "The fully compiled joint graph matches the eager joint graph on two steps with fresh inputs and, between them, an in-place update of every parameter (as an optimizer step makes): relative norm of the difference at most 1e-2, outputs and every gradient; `run_joint(..., fn=...)` calls the compiled callable exactly once per step, and while it runs no cast to FP8 and no op Inductor always turns into generated code reaches torch's dispatcher (the whole step runs compiled)."),
    _p("NUM-002", "MUST", "compile.regional", "The regionally compiled joint graph matches eager the same way."),
    _p("NUM-003", "MUST", "compile.regional", "The compiled nodes are exactly the tagged ones, and so is what runs: while the compiled graph runs, every node reported eager that runs reaches the dispatcher (per op overload, as often as the distinct computations of such nodes dispatch it when the graph runs eagerly); no op that Inductor always turns into generated code (pointwise, lowered, never a fallback kernel) and that only tagged nodes dispatch reaches it; and no more casts to FP8 reach it than lie outside the tagged regions."),
    _p("NUM-004", "MUST", "cudagraph", "On CUDA (sm89+), a regionally compiled graph captured in a CUDA graph matches eager at capture and at two replays with fresh inputs."),
    _p("NUM-005", "MUST", "mx", "In a drawn model with real MX modules, compiled fully and regionally (each mode the backend claims), every call with FP8 operands and e8m0 scales (uint8 bytes or `float8_e8m0fnu`) receives scale bytes that some eager call of the same joint graph receives, and every eager call's scale bytes reach some compiled call (observed at torch's dispatcher: the e8m0 scales reach the block-scaled matmul unaltered, compiled or not); outputs and gradients match eager within 1e-2 relative norm.", since="1.3"),
    _p("BND-001", "MUST", "graphpp", "`forward`, then `backward_input`, then `backward_weight`, wired by the suite by the AOT `StageSplit` convention or run by the backend's runner (`StageSplit.run`: each callable called once, in that order, and `backward_weight` fed only what the other two returned or the step was given), reproduce the unsplit joint graph's outputs and every gradient bitwise, for the stage as traced and after torch's joint-graph CSE."),
    _p("BND-002", "MUST", "graphpp", "The FP8 compute the forward callable's outputs need is as much as the stage's outputs need in its forward pass, and that of `backward_input` and `backward_weight` together as much as in its backward pass: none dropped, none duplicated; no callable holds FP8 compute its outputs do not need, beyond the grad_input matmuls the stage graph keeps for an in-place op."),
    _p("BND-003", "MUST", "graphpp", "The callables quantize (nodes making FP8 from non-FP8 inputs, counted where the outputs need them) exactly as often as the stage graph, per pass: a tensor cast once in dI reaches dW as that FP8 tensor, never cast again; a value dW receives from dI keeps its dtype."),
    _p("BND-004", "MUST", "graphpp", "In each callable, every tagged group is complete by the suite's own check (placeholders are boundaries), and per pass at least as many FP8 compute nodes are tagged in the callables as in the stage graph: a region cut at an FP8 placeholder (a value carried across the cut) stays tagged."),
    _p("BND-005", "MUST", "graphpp", "Per pass, the FP8 casts and compute the callables' outputs need carry the same provenance (as a multiset) as those the stage graph's outputs need; a node kept under its name keeps its provenance."),
    _p("BND-006", "SHOULD", "graphpp", "Strict validation of each callable of a valid split passes (a callable is not failed for compute living in a sibling), and `split_stage(strict=True)` of a stage whose FP8 compute lost its provenance raises a `ValidationFailure` (not a `SplitFailure`) before cutting."),
    _p("BND-007", "MUST", "graphpp", "`backward_weight` holds the backward FP8 compute that no input gradient depends on, and `backward_input` holds none of it: per module, dI's FP8 compute is exactly the stage's backward FP8 compute some input gradient depends on.", since="1.1"),
    _p("MOE-001", "MUST", "moe", "In a drawn MoE model, every FP8 compute node, forward and backward, carries the provenance of the experts module that issued it (the suite's own ground truth), kind `float8_grouped_experts`, recipe `rowwise` (where the backend records recipes) and the module's `emulate`; no node of the router or of the routing carries provenance.", since="1.1"),
    _p("MOE-002", "MUST", "moe", "Strict validation accepts every drawn MoE model's graph, and the report's FP8 compute counts per `(experts module, pass)` are those the outputs need: forward one grouped GEMM per call; backward one grad_input grouped GEMM when the call's input needs a gradient (a count may add one the graph keeps for an in-place op) and one grad_weight grouped GEMM; emulated experts none.", since="1.1"),
    _p("MOE-003", "MUST", "moe", "When the FP8 grouped GEMMs of one experts module in one pass are replaced by high-precision `torch._grouped_mm` calls (same offsets), strict validation fails with an error naming that module and that pass.", since="1.1"),
    _p("MOE-004", "MUST", "moe", "Every FP8 grouped GEMM lies in exactly one reported region, which is reported complete and tagged; every tagged group is complete by the suite's own check, comes from one experts call in one pass, holds, in the forward, the casts to FP8 of both matrix operands of its grouped GEMM (the 2-D tokens and the 3-D expert weights), and does not hold the computation of the token-group offsets, which enter it as a boundary.", since="1.1"),
    _p("MOE-005", "MUST", "moe", "`split_stage` of a drawn MoE stage puts each forward grouped GEMM in `forward`; per experts module, `backward_input` holds exactly the grouped GEMMs some input gradient of the stage depends on and `backward_weight` the rest (each call's grad_weight among them); the expert weight gradients are outputs of `backward_weight` (in `param_grads`, for a split with the AOT convention).", since="1.1"),
    _p("MOE-006", "MUST", "moe", "Per-group scales are never shared across groups: multiplying the tokens of one group by 2**12 changes, bitwise, no other expert's weight gradient and no other group's output or input gradient (real FP8 experts where the device runs FP8 grouped GEMMs, emulated ones elsewhere).", since="1.1"),
    _p("MOE-007", "MUST", "moe", "Empty token groups and all-zero (padding) token rows issue no NaN or infinity: the output and every gradient are finite, and the weight gradient of an expert whose group is empty is exactly zero (real or emulated experts as in MOE-006).", since="1.1"),
    _p("MOE-008", "MUST", "moe", "On CUDA (sm90), full and regional compile of a drawn MoE model's joint graph (real FP8 experts) match the eager joint graph on two steps with fresh inputs: relative norm of the difference at most 1e-2, outputs and every gradient.", since="1.1"),
    _p("DP-001", "MUST", "distributed", "With float8 all-gather on (`shard_data_parallel(model, mesh, float8_all_gather=True)` of a drawn tensorwise float8 model, traced over torch's fake process group as rank 0 of 2), every quantized module's weight is all-gathered in the forward pass, and every forward all-gather whose result reaches the weight operand of a quantized module's forward matmul moves FP8 bytes: one byte per element on the wire (an FP8 dtype, or one-byte integers holding FP8), reaching an FP8 matmul through views only (no arithmetic after the gather), whose scale operand for it is not computed from the gathered bytes; none moves the weight in high precision.", since="1.3"),
    _p("DP-002", "MUST", "distributed", "With float8 all-gather off (`float8_all_gather=False`, the model converted so), every quantized module's weight is still all-gathered in the forward pass, no forward all-gather reaching the weight operand of a quantized module's forward matmul moves FP8 bytes (an FP8 dtype on the wire, or one-byte integers viewed from or as FP8), and each module keeps one forward FP8 matmul per call.", since="1.3"),
    _p("DP-003", "MUST", "distributed", "The data-parallel step, traced by `trace_joint` and run by `run_joint` in 2 gloo processes on CPU, each rank on its half of the batch, gives every parameter gradient (whole, a `DTensor`, or the rank's dim-0 shard) within 1e-5 relative norm of the mean over the ranks of the unsharded eager step's gradients on each rank's half (the ranks' gradients averaged, each half cast to FP8 as on its rank), float8 all-gather on and off.", since="1.3"),
    _p("DP-004", "MUST", "distributed", "`shard_tensor_parallel` of a drawn two-layer float8 model with the plan `{first layer: \"colwise\", second: \"rowwise\"}`, traced over the fake process group as rank 0 and as rank 1 of 2, keeps each module's FP8 compute on each rank: per call one forward FP8 matmul, on the rank's shard of the weight (colwise: half the output features; rowwise: half the input features), and the recipe's backward FP8 matmuls.", since="1.3"),
    _p("DP-005", "MUST", "distributed", "Quantize after gather (a backend whose `weight_gathers` declare `high_precision`): with float8 all-gather off, traced as DP-002 is, every all-gather reaching a quantized module's forward FP8 weight operand moves high precision, the operand is cast to FP8 on the path from the gather's output to the matmul, and the weight's scale is computed from the gather's output (the whole weight, on every rank), not from the rank's shard; DP-001 applies only to a backend that declares `float8`, DP-002 only to one that declares `high_precision`, and DP-003 runs the declared settings.", since="1.5"),
    _p("FPR-001", "MUST", "fingerprint", "Changing any one quantization input (recipe, `emulate`, the set of converted modules or which of two equal layers is converted, a numerics-relevant config field from a named recipe or a custom config, `strict`, the torch or torchao version as `__version__` and package metadata state it) changes the fingerprint, whatever its scope, for every kind of quantized module the backend claims (float8, MX, swizzled MX, linears on `F.scaled_mm`, NVFP4, grouped experts on either grouped API; a linear on `F.scaled_mm` changes to its kind's other recipe, an MX or NVFP4 layer to a float8 one, grouped experts to the other grouped API where the backend claims both); a model with a config field flipped that the backend's jobs cannot express (`expressible_config_fields`) may be refused instead (`UnsupportedConfig`, not_supported), never keyed as if unchanged; refusing a model converted from named recipes fails."),
    _p("FPR-002", "MUST", "fingerprint", "Equal configs give equal fingerprints and signatures: rebuilt, and in processes with other `PYTHONHASHSEED`s; registered in reverse order, equal signatures, and equal fingerprints where the backend's `fingerprint_scope` is `quantization`."),
    _p("FPR-003", "MUST", "fingerprint", "Settings unrelated to quantization change neither the signature nor the fingerprint, except that a fingerprint of `fingerprint_scope` `whole_step` may change with the model's structure (unrelated buffers, the model around the quantized modules)."),
    _p("FPR-004", "MUST", "artifacts", "An artifact loads under its own fingerprint (and runs within 3e-2 relative norm of the joint graph); under any changed quantization input the backend's jobs can express `load_artifact` raises `conformance.api.FingerprintMismatch` whose `fields` or message name the changed module and field (or `strict`, or the version), returning nothing; refusing an inexpressible config (`UnsupportedConfig`) is `not_supported`."),
    _p("FPR-005", "SHOULD", "fingerprint", 'The signature is canonical JSON (an object; `json.dumps(sort_keys=True, separators=(",", ":"))` of itself) naming each quantized module\'s FQN as a key and its recipe; a change to one module differs only in fields under that module\'s key, a global change only outside every module\'s (the signature of a `whole_step` backend may leave a global change to the fingerprint), and some differing field names what changed.'),
    _p("FPR-006", "MUST", "fingerprint", "For a backend that declares job configurations (`job_configs()`), `fingerprint(model, config=...)` differs from the one under the base configuration for every `relevant` variant and `quantization_signature(model, config=...)` equals the base one for every `unrelated` variant; where `fingerprint_scope` is `quantization` the signature also differs for every `relevant` variant and the fingerprint also equals for every `unrelated` one. A backend without job configurations gets `not_supported`.", since="1.1"),
    _p("E8M0-001", "MUST", "e8m0", "`scaled_mm_e8m0` equals blockwise dequantize-then-matmul (block 32 along K, byte `s` meaning `2**(s - 127)`) computed in float64 by the suite from the bytes, within a float32 accumulation and one rounding to `out_dtype`; shapes M, N multiples of 16, K of 32, scale bytes including 0, 1, 127 and 254, elements near e4m3 saturation (±448) and tiny ones, every output dtype, operands row-major or laid out as a linear layer passes them (`b` a transposed weight, `a` non-contiguous)."),
    _p("E8M0-002", "MUST", "e8m0", "Byte 255 makes exactly the outputs whose row of `a` or column of `b` uses its block NaN (also when the block's elements are zero); byte 0 means `2**-127`, never flushed: outputs are nonzero wherever the reference's are beyond the tolerance."),
    _p("E8M0-003", "MUST", "e8m0", "`torch.library.opcheck` passes on `e8m0_op()` (with float8 `torch.allclose` compared bytewise on CPU), and `scaled_mm_e8m0` on fake tensors gives the (M, N) `out_dtype` result."),
    _p("E8M0-004", "MUST", "e8m0", "A step calling `scaled_mm_e8m0` compiles under `torch.compile(fullgraph=True)` with CPU Inductor into one graph (no graph break) holding exactly one `e8m0_op()` node, which Inductor's output code calls once as an extern op; no e8m0 dtype (`float8_e8m0fnu`) appears in that code; the result equals eager bitwise."),
    _p("E8M0-005", "MUST", "e8m0", "Non-e4m3 operands, K not a multiple of 32, and scales of the wrong shape or dtype (float, int8/int32) raise an exception whose message names the argument (`a`, `b`, `a_scale` or `b_scale`, quoted or after the word `argument`)."),
    _p("E8M0-006", "MUST", "e8m0", "Scales given as `float8_e8m0fnu` (either or both) are refused with an exception naming the argument, or read as the same bytes: the result equals, NaN for NaN, the one their `uint8` view gives (bytes 0, 1, 127, 254 and 255 included), in eager and, where the installed torch's CPU Inductor compiles e8m0, compiled under `torch.compile(fullgraph=True)`.", since="1.4"),
    _p("NVF-001", "MUST", "nvfp4", "Every NVFP4 matmul keeps its declared layout: in the traced graph and in each piece of its GraphPP split (with capability `graphpp`), every low-precision matmul on packed FP4 operands is `aten._scaled_mm_v2` with, per operand, scale recipes `[BlockWise1x16, TensorWise]`, swizzles `[SWIZZLE_32_4_4, NO_SWIZZLE]`, `float8_e4m3fn` block scales of rows padded to 128 times K/16 padded to 4 elements and one float32 global scale; and each real NVFP4 module issues, by the suite's count, one forward matmul per call and backward one for grad_input where its input needs a gradient and one for grad_weight.", since="1.5"),
    _p("NVF-002", "MUST", "nvfp4", "An NVFP4 step computes what its declared layout means: run on fresh inputs, with its NVFP4 matmuls executed by the device's kernel or, where the device has none, by the suite's reading of the declared layout, every NVFP4 matmul of the graph runs; each operand, dequantized with its scales read in the declared layout, is within 0.3 in relative norm of a high-precision tensor it was computed from (observed at torch's dispatcher); and the step's output and every gradient are within 1 in relative norm of the same weights' high-precision step.", since="1.5"),
    _p("MXS-001", "MUST", "mx", "Every swizzled MX matmul keeps its declared layout (a backend whose `mx_recipes` declare `mxfp8_swizzled`): every low-precision matmul a swizzled MX module issues (by the suite's attribution) in the traced graph, every MX matmul (operands FP8, scales `float8_e8m0fnu`) in each piece of its GraphPP split (with capability `graphpp`), and every one the compiled step runs (with capability `compile.full` or `compile.regional`, where the backend's compile accepts the graph; a refusal is noted in the report row), is `aten._scaled_mm_v2` with `float8_e4m3fn` operands and, per operand, scale recipe `[BlockWise1x32]`, swizzle `[SWIZZLE_32_4_4]` and `float8_e8m0fnu` scales of rows padded to 128 times K/32 padded to 4 elements; each swizzled MX module issues one forward matmul per call and backward one for grad_input where its input needs a gradient and one for grad_weight; the split's pieces and the compiled step hold as many MX matmuls as the traced graph.", since="1.5"),
    _p("MXS-002", "MUST", "mx", "A swizzled MX step computes what its declared layout means: run on fresh inputs, with its swizzled MX matmuls executed by the device's kernel or, where the device has none, by the suite's reading of the declared layout, every one of them runs; each operand, dequantized with its e8m0 scales read in the declared layout, is within 0.15 in relative norm of a high-precision tensor it was computed from (observed at torch's dispatcher); and the step's output and every gradient are within 1 in relative norm of the same weights' high-precision step.", since="1.5"),
    _p("RWR-001", "MUST", "rewrites", "A rewrite keeps every module's FP8 compute and its provenance: per (module, pass) the rewritten graph holds, by the suite's count, the FP8 compute the traced graph holds, and each of its FP8 compute nodes carries the provenance of the module that issued it.", since="1.5"),
    _p("RWR-002", "MUST", "rewrites", "A rewrite keeps where a GraphPP split puts each module's FP8 compute: `split_stage` of the rewritten graph puts as much FP8 compute of each module, and as many high-precision matmuls, in the forward, dI and dW callables as `split_stage` of the traced graph does (with capability `graphpp`).", since="1.5"),
    _p("RWR-003", "MUST", "rewrites", "A rewrite keeps the graph's inputs: the rewritten graph's placeholders are the traced graph's, as many, in order, each of the same dtype and shape (FP8 ones included).", since="1.5"),
    _p("RWR-004", "MUST", "rewrites", "A rewritten step computes what the traced step did: run on fresh inputs, every output and gradient of the rewritten graph is within 1e-3 in relative norm of the traced graph's.", since="1.5"),
]

PROPERTIES: dict[str, Property] = {p.id: p for p in _ALL}


def relied_on(property_id: str) -> tuple[str, ...]:
    """Every property ``property_id`` relies on, directly or through others, nearest first."""
    found: list[str] = []
    pending = list(get_property(property_id).relies_on)
    while pending:
        other = pending.pop(0)
        if other not in found:
            found.append(other)
            pending.extend(PROPERTIES[other].relies_on)
    return tuple(found)


def get_property(property_id: str) -> Property:
    try:
        return PROPERTIES[property_id]
    except KeyError:
        raise KeyError(f"unknown spec property {property_id!r}; known: {', '.join(PROPERTIES)}") from None

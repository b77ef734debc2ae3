"""The contract a backend implements to be checked by the suite.

Subclass :class:`Backend`, set ``name`` and ``capabilities``, implement the methods of the
capabilities you claim, and register the class under the entry-point group ``fp8conf.backends``
(or pass ``--fp8-backend=package.module:Class``). Methods of capabilities you do not claim keep
their default, which raises :class:`NotImplementedError`; the suite never calls them.

Calling conventions:

* ``trace_joint(model, args)`` returns one joint forward+backward ``torch.fx.GraphModule`` of a
  training step with ``model`` called on positional ``args``. The suite treats the graph's inner
  structure as the backend's business, but it reads ``node.meta["val"]`` (fake tensors, for
  dtypes and shapes) and ``node.meta["seq_nr"]`` (the autograd sequence number every
  AOTAutograd joint graph records, used to pair backward nodes with the forward op they
  differentiate).
* ``run_joint(gm, model, args, grad_outputs)`` executes that graph with the model's current
  parameters and returns ``(outputs, grads)``: the forward outputs as a tuple and a dict from
  parameter FQN (``"0.proj.weight"``) to its gradient, plus ``"input.<i>"`` keys for positional
  inputs that require grad.
* ``validate(gm, strict=...)`` raises :class:`~conformance.api.errors.ValidationFailure` (or a
  subclass) in strict mode and returns a :class:`~conformance.api.types.ValidationReport`
  otherwise; it must never change the graph.
* The exceptions a rule asks for come from :mod:`conformance.api.errors`: ``ValidationFailure``
  (strict validation, also from ``split_stage(strict=True)``), ``SplitFailure`` (a stage that
  cannot be cut), ``FingerprintMismatch`` (``load_artifact``) and ``UnsupportedConfig`` (a
  model whose quantization config the backend's jobs cannot express). The suite catches exactly
  those; a backend whose passes raise their own maps them in its adapter.
* Models the suite draws hold float8 layers: TorchAO's ``Float8Linear`` or, for a backend that
  claims ``float8_modules``, the backend's own float8 linears, built by
  :meth:`Backend.convert_float8` with only the recipes it declares (:attr:`Backend.float8_recipes`,
  emulated only when :attr:`Backend.float8_emulation`); and, only for a
  backend that claims ``mx``, MX layers that the backend converts itself (:meth:`Backend.convert_mx`);
  for a backend that claims ``moe``, mixture-of-experts layers whose experts it converts itself
  (:meth:`Backend.convert_grouped_experts`); for a backend that claims ``scaled_mm_v2``, linears
  it converts itself into FP8 linears computing through ``torch.nn.functional.scaled_mm``
  (:meth:`Backend.convert_scaled_mm`); for a backend that claims ``scaled_grouped_mm_v2`` (with
  ``moe``), experts it converts itself into FP8 grouped experts computing through
  ``torch.nn.functional.scaled_grouped_mm`` (:meth:`Backend.convert_scaled_grouped_experts`); for a
  backend that claims ``nvfp4``, NVFP4 linears it converts itself (:meth:`Backend.convert_nvfp4`).
* Graphs the suite hands to a backend are the suite's copies: a backend may tag or rewrite
  them in place (``node.meta["custom"]`` included) without affecting other properties.
* Models and their inputs are built on the suite's device (``--fp8-device=cpu|cuda``; CPU by
  default): a backend traces what it is given and keeps it there.

What a backend must record, per property (everything else is optional):

* ``node.meta["val"]`` on every node (all properties); ``node.meta["seq_nr"]`` on forward and
  backward nodes (PROV-003, and the suite's pairing of backward nodes with their module);
* :class:`~conformance.api.types.Provenance` ``module_fqn``, ``kind`` and ``emulate`` (PROV,
  BND-005); ``recipe`` only when :attr:`Backend.provenance_has_recipe` (PROV-002);
* on a :class:`~conformance.api.errors.ValidationFailure`: the module and the pass it concerns
  (VAL-002, VAL-006, VAL-007, EMU-002) and the node (VAL-003), each as the error's attribute or
  named in its message; a backend that sets an attribute must set it right.

What a backend declares about its fingerprint (capability ``fingerprint``):

* :attr:`Backend.fingerprint_scope`: what the fingerprint covers, one of
  :data:`~conformance.api.types.FINGERPRINT_SCOPES`. ``"quantization"`` (the default): the
  digest of the quantization signature alone, which ignores structure and registration order.
  ``"whole_step"``: a key of the whole training step, which may also cover the model's
  structure and registration order and the whole job configuration, while the signature may
  describe the quantized modules only. FPR-002, FPR-003, FPR-005 and FPR-006 then leave the
  fingerprint free to change with structure, and the signature free to leave out global inputs.
* :attr:`Backend.expressible_config_fields`: the ``Float8LinearConfig`` fields (dotted paths,
  ``"cast_config_input.target_dtype"``) the backend's jobs can set one by one; the suite flips
  only those. ``None`` (the default): every field; a refusal
  (:class:`~conformance.api.errors.UnsupportedConfig`) of a model with flipped fields is then
  ``not_supported``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from conformance.api.spec import SPEC_VERSION
from conformance.api.types import (
    CAPABILITIES, FINGERPRINT_SCOPES, FLOAT8_RECIPES, MX_RECIPES, TORCH_COMPUTE_OPS, WEIGHT_GATHERS, ComputeOp, Compiled, JobConfigs, Provenance, Region, StageSplit, ValidationReport,
)

if TYPE_CHECKING:  # torch stays unimported until a backend is actually used
    import torch

__all__ = ["Backend"]


class Backend(abc.ABC):
    """A backend under test. One instance serves the whole pytest session."""

    #: Name shown in reports and error messages.
    name: str = "unnamed"
    #: The backend's own version, recorded in reports.
    version: str = "0"
    #: Subset of :data:`conformance.CAPABILITIES` this backend implements.
    capabilities: frozenset[str] = frozenset()
    #: The spec version the backend claims: properties added after it are skipped as
    #: not_supported (``--fp8-spec-version`` overrides it).
    spec_version: str = SPEC_VERSION
    #: Whether :meth:`provenance` reports the recipe. A backend that records only the module,
    #: kind and emulation sets it False: PROV-002 then checks those, and says so in the report.
    provenance_has_recipe: bool = True
    #: What :meth:`fingerprint` covers, one of :data:`~conformance.api.types.FINGERPRINT_SCOPES`:
    #: ``"quantization"`` (the quantization signature alone) or ``"whole_step"`` (a key of the
    #: whole training step, which may change with the model's structure and registration order
    #: and with any job setting).
    fingerprint_scope: str = "quantization"
    #: The ``Float8LinearConfig`` fields, as dotted paths (``"round_scales_to_power_of_2"``,
    #: ``"cast_config_input.target_dtype"``), that the backend's jobs can change one by one, or
    #: None for every field. A trainer that builds configs from recipe names declares
    #: ``frozenset()``: the suite then draws no config-field change for it.
    expressible_config_fields: frozenset[str] | None = None
    #: The recipes of the backend's own float8 linears (capability ``float8_modules``), a
    #: non-empty subset of :data:`~conformance.api.types.FLOAT8_RECIPES`. The suite draws float8
    #: layers of these recipes only; a property asking only for others is ``not_supported``.
    float8_recipes: frozenset[str] = frozenset(FLOAT8_RECIPES)
    #: Whether the backend's own float8 linears have an emulated mode (capability
    #: ``float8_modules``): without one the suite draws no emulated float8 layer, and a property
    #: about emulated modules only is ``not_supported``.
    float8_emulation: bool = True
    #: The recipes of the backend's MX linears (capability ``mx``), a non-empty subset of
    #: :data:`~conformance.api.types.MX_RECIPES`: ``mxfp8`` and ``mxfp8_emulated`` (declared
    #: together: MX layers whose matmuls may take any API, with their emulated mode) and
    #: ``mxfp8_swizzled`` (MXFP8 on ``F.scaled_mm`` with swizzled e8m0 scales). The suite draws MX
    #: layers of the declared recipes only.
    mx_recipes: frozenset[str] = frozenset({"mxfp8", "mxfp8_emulated"})
    #: How the backend's data-parallel steps move quantized weights (capability ``distributed``),
    #: a non-empty subset of :data:`~conformance.api.types.WEIGHT_GATHERS`: ``float8`` (gathered
    #: as FP8 bytes: DP-001) and ``high_precision`` (gathered in high precision, quantized after
    #: the gather: DP-002, DP-005). The suite asks :meth:`shard_data_parallel` only for the
    #: declared ones; a property about another is ``not_supported``.
    weight_gathers: frozenset[str] = frozenset(WEIGHT_GATHERS)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.capabilities) - CAPABILITIES
        if unknown:
            raise TypeError(
                f"{cls.__qualname__}.capabilities names unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if cls.fingerprint_scope not in FINGERPRINT_SCOPES:
            raise TypeError(
                f"{cls.__qualname__}.fingerprint_scope is {cls.fingerprint_scope!r}; known: {list(FINGERPRINT_SCOPES)}"
            )
        recipes = cls.float8_recipes
        if isinstance(recipes, str) or not recipes or not set(recipes) <= set(FLOAT8_RECIPES):
            raise TypeError(
                f"{cls.__qualname__}.float8_recipes must be a non-empty set of {list(FLOAT8_RECIPES)}, got {recipes!r}"
            )
        mx = cls.mx_recipes
        if (isinstance(mx, str) or not mx or not set(mx) <= set(MX_RECIPES)
                or len({"mxfp8", "mxfp8_emulated"} & set(mx)) == 1):
            raise TypeError(
                f"{cls.__qualname__}.mx_recipes must be a non-empty set of {list(MX_RECIPES)} holding both or neither "
                f"of 'mxfp8' and 'mxfp8_emulated', got {mx!r}"
            )
        gathers = cls.weight_gathers
        if isinstance(gathers, str) or not gathers or not set(gathers) <= set(WEIGHT_GATHERS):
            raise TypeError(
                f"{cls.__qualname__}.weight_gathers must be a non-empty set of {list(WEIGHT_GATHERS)}, got {gathers!r}"
            )
        fields = cls.expressible_config_fields
        if fields is not None and (isinstance(fields, str) or not all(isinstance(f, str) for f in fields)):
            raise TypeError(
                f"{cls.__qualname__}.expressible_config_fields must be None or a set of dotted field paths, got {fields!r}"
            )

    # -- tracing and provenance -------------------------------------------------------------
    @abc.abstractmethod
    def trace_joint(self, model: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
        """Trace one training step of ``model(*args)`` into a joint forward+backward graph."""

    @abc.abstractmethod
    def run_joint(
        self,
        gm: torch.fx.GraphModule,
        model: torch.nn.Module,
        args: tuple,
        grad_outputs: tuple,
        *,
        fn=None,
    ) -> tuple[tuple, dict[str, torch.Tensor]]:
        """Execute the joint graph, or ``fn`` (a compiled version of it from :meth:`compile`) in
        its place; see the module docstring for the return convention."""

    @abc.abstractmethod
    def provenance(self, node: torch.fx.Node) -> Provenance | None:
        """The neutral view of the provenance the backend attached to ``node``."""

    @abc.abstractmethod
    def is_backward(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` belongs to the backward pass of the joint graph."""

    def fp8_compute_ops(self) -> tuple[ComputeOp, ...]:
        """The ops that are FP8 compute in the backend's graphs, what its passes count and keep
        as such: torch's scaled matmuls by default (:data:`~conformance.api.types.TORCH_COMPUTE_OPS`),
        and a trainer's own ops (a fused weight-gradient accumulation, a kernel of its own),
        each with its operand and scale positions. The suite counts a declared op as FP8 compute
        where its operands are low precision (its own ground truth), and VAL-008 checks the
        declaration against the graphs: low-precision compute (two FP8 or packed FP4 tensors into
        a high-precision result) the backend does not declare, or a declared op the step calls
        on high-precision operands, fails. The e8m0 op (:meth:`e8m0_op`) counts without being
        listed."""
        return TORCH_COMPUTE_OPS

    # -- post-trace rewrites ------------------------------------------------------------------
    def rewrite(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """The passes the backend runs on a traced joint graph before anything else reads it
        (capability ``rewrites``): fusions, FP8 op rewrites, common-subexpression elimination.
        Returns the rewritten graph (``gm`` itself, changed in place, will do). With it claimed,
        every property runs on the rewritten graph, and the RWR properties compare it with the
        graph as traced: each module's FP8 compute and provenance, the GraphPP placement of its
        compute and the FP8 values the stages pass, the graph's inputs, and what the step
        computes. ``run_joint`` and every other method take the rewritten graph as they take a
        traced one."""
        raise NotImplementedError(f"backend {self.name!r} does not implement rewrite()")

    # -- validation ---------------------------------------------------------------------------
    def validate(self, gm: torch.fx.GraphModule, *, strict: bool) -> ValidationReport:
        """Check the FP8 rules on ``gm`` (capability ``validation``)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement validate()")

    # -- regions ------------------------------------------------------------------------------
    def regions(self, gm: torch.fx.GraphModule) -> list[Region]:
        """Identify the FP8 regions of ``gm`` and tag the complete ones in place (capability
        ``regions``): tagged nodes carry ``node.meta["custom"]["compile_with_inductor"]``, and the
        nodes of two regions must never merge when compiled. Other annotations stay intact."""
        raise NotImplementedError(f"backend {self.name!r} does not implement regions()")

    # -- compilation --------------------------------------------------------------------------
    def compile(self, gm: torch.fx.GraphModule, *, mode: str, cudagraph: bool = False) -> Compiled:
        """Compile ``gm`` with Inductor, ``mode`` ``"full"`` (capability ``compile.full``) or
        ``"regional"`` (``compile.regional``: only the complete FP8 regions); ``cudagraph=True``
        (capability ``cudagraph``) captures the result in a CUDA graph. ``gm`` is not changed."""
        raise NotImplementedError(f"backend {self.name!r} does not implement compile()")

    # -- GraphPP ------------------------------------------------------------------------------
    def split_stage(self, gm: torch.fx.GraphModule, *, strict: bool = True) -> StageSplit:
        """Cut the joint graph of one pipeline stage into forward, backward-input (dI) and
        backward-weight (dW) callables (capability ``graphpp``). The result carries the three
        ``torch.fx.GraphModule`` callables and how they run: a runner (``StageSplit.run``, for
        any tracer) or the AOT calling convention (see :class:`conformance.StageSplit`).
        ``strict``: validate the whole stage first and raise its
        :class:`~conformance.api.errors.ValidationFailure` before cutting; a stage that cannot be
        cut raises :class:`~conformance.api.errors.SplitFailure`. ``gm`` is not changed. Each
        callable keeps node provenance, and :meth:`validate` and :meth:`regions` accept it."""
        raise NotImplementedError(f"backend {self.name!r} does not implement split_stage()")

    # -- fingerprint --------------------------------------------------------------------------
    def quantization_signature(self, model: torch.nn.Module, *, strict: bool = True, config=None) -> str:
        """The quantization signature of ``model`` compiled under ``strict`` as canonical JSON
        text: a JSON object with sorted keys and ``(",", ":")`` separators, every quantized module
        under a key equal to its FQN (capability ``fingerprint``). ``config`` is one of the
        backend's own job configurations (:meth:`job_configs`); the suite passes it only to a
        backend that declares some, and otherwise leaves it out. A model whose quantization
        config the backend's jobs cannot express raises
        :class:`~conformance.api.errors.UnsupportedConfig`."""
        raise NotImplementedError(f"backend {self.name!r} does not implement quantization_signature()")

    def fingerprint(self, model: torch.nn.Module, *, strict: bool = True, config=None) -> str:
        """The fingerprint of ``model``: a hex digest, equal in every process for equal models
        built alike (capability ``fingerprint``; ``config`` as above). What it covers is
        :attr:`fingerprint_scope`'s: the quantization signature alone, or the whole step."""
        raise NotImplementedError(f"backend {self.name!r} does not implement fingerprint()")

    def job_configs(self) -> JobConfigs | None:
        """The backend's own job configurations the suite varies (FPR-006), or None when its
        signature depends on the model and ``strict`` only (capability ``fingerprint``)."""
        return None

    # -- artifacts ----------------------------------------------------------------------------
    def save_artifact(self, path: str, model: torch.nn.Module, args: tuple, *, strict: bool = True) -> None:
        """Trace, compile and save the training step of ``model(*args)`` at ``path`` together with
        its fingerprint (capability ``artifacts``)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement save_artifact()")

    def load_artifact(self, path: str, model: torch.nn.Module, *, strict: bool = True):
        """Load the artifact at ``path`` for ``model``'s current FP8 configuration and return a
        callable ``fn(args, grad_outputs) -> (outputs, grads)`` (the ``run_joint`` convention, with
        ``model``'s current parameters). An artifact of another fingerprint raises
        :class:`~conformance.api.errors.FingerprintMismatch` naming the differing fields (in
        ``fields``, or else in its message) and is never used (capability ``artifacts``). A model
        whose quantization config the backend's jobs cannot express may raise
        :class:`~conformance.api.errors.UnsupportedConfig` instead."""
        raise NotImplementedError(f"backend {self.name!r} does not implement load_artifact()")

    # -- the backend's own float8 linears ------------------------------------------------------
    def convert_float8(self, model: torch.nn.Module, *, module_filter_fn, recipe: str, emulate: bool) -> None:
        """Convert, in place, the ``nn.Linear`` submodules of ``model`` that
        ``module_filter_fn(module, fqn)`` accepts into the backend's own float8 linears
        (capability ``float8_modules``; kind ``float8_linear``). ``recipe`` is one of
        :attr:`float8_recipes`; ``emulate`` True (only when :attr:`float8_emulation`) computes in
        high precision on purpose (no FP8 compute). A call issues the FP8 matmuls of TorchAO's
        recipe of that name: one forward; in the backward one for grad_input when the call's
        input needs a gradient, and one for grad_weight unless the recipe is
        ``rowwise_with_gw_hp`` (whose weight gradient is high precision). Provenance: kind
        ``float8_linear``, the recipe's name, ``emulate``. How the module quantizes, which
        scaled-matmul API it calls and its autograd are the backend's. The suite calls it again
        on a converted module to nest a linear inside it (an adapter the module's forward adds):
        it converts the accepted ``nn.Linear`` and leaves converted ones alone. A backend that
        claims ``float8_modules`` gets every float8 layer the suite draws through this method,
        in every property but DP-004, whose tensor-parallel contract names TorchAO's FP8 styles."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_float8()")

    # -- MX layers ----------------------------------------------------------------------------
    def convert_mx(self, model: torch.nn.Module, *, module_filter_fn, recipe: str) -> None:
        """Convert, in place, the ``nn.Linear`` submodules of ``model`` that
        ``module_filter_fn(module, fqn)`` accepts into the backend's own MX block-scaled linears
        (capability ``mx``; kind ``mxfp8_linear``). ``recipe`` is one of :attr:`mx_recipes`:
        ``"mxfp8"`` (real MXFP8 compute), ``"mxfp8_emulated"`` (emulated: exempt from FP8
        compute) or ``"mxfp8_swizzled"`` (every matmul, output; grad_input when the call's input
        needs a gradient; grad_weight, through ``F.scaled_mm`` on ``float8_e4m3fn`` operands,
        each with ``float8_e8m0fnu`` scales of blocks of 32 along the contraction dim in the
        ``SWIZZLE_32_4_4`` layout: recipe ``BlockWise1x32``, swizzle ``SWIZZLE_32_4_4``); in and
        out features are multiples of 32. The suite draws models with MX layers only for a
        backend that claims ``mx`` and builds them through this method; their provenance has
        kind ``mxfp8_linear`` and the recipe's name. The FP8 compute of ``mxfp8`` is one of
        torch's scaled matmuls or, for a backend that also claims ``e8m0``, a call of
        :meth:`e8m0_op`. Swizzled MX graphs trace on any device (torch's Meta kernel); only a
        device with an MX kernel (sm100) runs them."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_mx()")

    # -- linears on the second scaled-matmul API ----------------------------------------------
    def convert_scaled_mm(self, model: torch.nn.Module, *, module_filter_fn, recipe: str) -> None:
        """Convert, in place, the ``nn.Linear`` submodules of ``model`` that
        ``module_filter_fn(module, fqn)`` accepts into the backend's own FP8 linears that compute
        through torch's second scaled-matmul API, ``torch.nn.functional.scaled_mm`` (which lowers
        to ``aten._scaled_mm_v2``; capability ``scaled_mm_v2``, torch 2.12 and newer; kind
        ``float8_scaled_mm_linear``). ``recipe`` is ``"tensorwise"`` (one scale per operand) or
        ``"rowwise"`` (one scale per row along each matmul's contraction dim); in and out features
        are multiples of 16. Every call issues its FP8 matmuls like ``tensorwise`` float8 linears:
        one forward, and backward one for grad_input when the call's input needs a gradient and
        one for grad_weight; nothing is emulated. Their provenance has kind
        ``float8_scaled_mm_linear``, the recipe's name and ``emulate`` False. The suite draws
        models with such layers only for a backend that claims ``scaled_mm_v2`` and builds them
        through this method; what the layer is (its class, how it quantizes) is the backend's."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_scaled_mm()")

    # -- NVFP4 layers ---------------------------------------------------------------------------
    def convert_nvfp4(self, model: torch.nn.Module, *, module_filter_fn, recipe: str) -> None:
        """Convert, in place, the ``nn.Linear`` submodules of ``model`` that
        ``module_filter_fn(module, fqn)`` accepts into the backend's own NVFP4 linears (capability
        ``nvfp4``, torch with ``float4_e2m1fn_x2`` and ``F.scaled_mm``; kind ``nvfp4_linear``).
        ``recipe`` is ``"nvfp4"``: every matmul (output; grad_input when the call's input needs a
        gradient; grad_weight) takes packed ``float4_e2m1fn_x2`` operands, each with its
        ``float8_e4m3fn`` scales of blocks of 16 along the contraction dim in the
        ``SWIZZLE_32_4_4`` layout and a float32 global scale, through ``F.scaled_mm`` (recipes
        ``[BlockWise1x16, TensorWise]``, swizzles ``[SWIZZLE_32_4_4, NO_SWIZZLE]``); or
        ``"nvfp4_emulated"``: quantized alike, computed in high precision on purpose (no
        low-precision compute). In and out features are multiples of 32. Provenance: kind
        ``nvfp4_linear``, the recipe's name, ``emulate`` True for the emulated one. The suite
        draws models with NVFP4 layers only for a backend that claims ``nvfp4`` and builds them
        through this method; the graphs trace on any device (torch's Meta kernel), and only a
        device with an NVFP4 kernel (sm100) runs them."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_nvfp4()")

    # -- grouped experts (MoE) ----------------------------------------------------------------
    def convert_grouped_experts(self, model: torch.nn.Module, *, module_filter_fn, recipe: str, emulate: bool) -> None:
        """Convert, in place, the experts modules of ``model`` that ``module_filter_fn(module, fqn)``
        accepts into the backend's FP8 grouped experts (capability ``moe``; kind
        ``float8_grouped_experts``). An experts module (the suite's
        ``conformance.draw.moe.GroupedExperts``) has a Parameter ``weight`` of shape ``(E, out, in)``,
        dims multiples of 16, and is called as ``module(x, offs)``: ``x`` ``(M, in)`` holds tokens
        sorted by expert, ``offs`` the ``(E,)`` int32 end offsets of the token groups (a group may
        be empty; ``offs[-1] == M``; every group's size a multiple of 16), and the result is
        ``x[g] @ weight[e].T`` per group ``g`` of expert ``e``. ``recipe`` is ``"rowwise"``: every
        grouped GEMM (output, grad_input, grad_weight) has both operands in FP8 with per-row
        scales along its contraction dim, and the grad_weight GEMM's scales are per token group;
        ``emulate=True`` computes in high precision on purpose (no FP8 compute). The converted
        module keeps the ``weight`` Parameter; its provenance has kind ``float8_grouped_experts``,
        recipe ``"rowwise"`` and ``emulate``. The suite draws MoE models only for a backend that
        claims ``moe``."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_grouped_experts()")

    def convert_scaled_grouped_experts(self, model: torch.nn.Module, *, module_filter_fn, recipe: str) -> None:
        """As :meth:`convert_grouped_experts` (never emulated), into FP8 grouped experts whose
        grouped GEMMs go through torch's second scaled-matmul API,
        ``torch.nn.functional.scaled_grouped_mm`` (``aten._scaled_grouped_mm_v2``; capability
        ``scaled_grouped_mm_v2``, with ``moe``; torch 2.12 and newer). Kind, provenance and the
        GEMMs each call issues are those of :meth:`convert_grouped_experts` with ``emulate``
        False. The suite draws such experts only for a backend that claims
        ``scaled_grouped_mm_v2`` and builds them through this method. torch ships a CUDA kernel
        of ``aten._scaled_grouped_mm_v2`` only, so on CPU the properties that trace (MOE-001 to
        MOE-005) trace them with fake tensors under a Meta kernel of the suite's
        (``conformance.draw.moe.v2_grouped_structure``), and those that run them (MOE-006 to MOE-008)
        do so only where the device runs them."""
        raise NotImplementedError(f"backend {self.name!r} does not implement convert_scaled_grouped_experts()")

    # -- sharded steps (capability ``distributed``) --------------------------------------------
    def shard_data_parallel(self, model: torch.nn.Module, mesh, *, float8_all_gather: bool) -> torch.nn.Module:
        """Shard ``model`` data-parallel over ``mesh`` (a one-dimensional
        ``torch.distributed.device_mesh.DeviceMesh``) and return the model to hand to
        :meth:`trace_joint` and :meth:`run_joint` (capability ``distributed``). Every rank calls
        it on an equal model; every dimension the suite draws divides by the mesh's size.

        The model's quantized modules are TorchAO ``Float8Linear``s converted with
        ``Float8LinearConfig.enable_fsdp_float8_all_gather`` equal to ``float8_all_gather``, as a
        trainer's config would say, or, for a backend that claims ``float8_modules``, its own
        float8 linears (built by :meth:`convert_float8`, of its first declared recipe). With it on,
        the traced step must all-gather their weights as FP8 bytes (DP-001); off, in high
        precision, each rank quantizing the gathered weight (DP-002, DP-005). The suite asks only
        for the settings :attr:`weight_gathers` declares. The traced step holds its
        collectives: the all-gathers as torch's functional collectives
        (``torch.ops._c10d_functional``), over ``mesh``'s process group, which for the structural
        properties is torch's fake process group (nothing moves; only the graph is read).
        ``run_joint`` of the sharded model returns each parameter's gradient averaged over the
        ranks (as FSDP2 and DDP do): the whole gradient, a ``DTensor``, or this rank's dim-0 shard."""
        raise NotImplementedError(f"backend {self.name!r} does not implement shard_data_parallel()")

    def shard_tensor_parallel(self, model: torch.nn.Module, mesh, *, plan: dict) -> torch.nn.Module:
        """Shard ``model``'s linears tensor-parallel over ``mesh`` (one-dimensional) and return the
        model to hand to :meth:`trace_joint` (capability ``distributed``). ``plan`` maps a
        module's FQN to ``"colwise"`` (weight split along its output features, the input
        replicated, the output left sharded for the next layer) or ``"rowwise"`` (split along its
        input features, taking that sharded input, the output reduced over the ranks), as
        torch's ``ColwiseParallel`` / ``RowwiseParallel`` do; the modules are TorchAO
        ``Float8Linear``s, which must keep their FP8 compute on every rank (DP-004)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement shard_tensor_parallel()")

    # -- the e8m0 op --------------------------------------------------------------------------
    def scaled_mm_e8m0(self, a, b, a_scale, b_scale, out_dtype):
        """MX block-scaled matmul (capability ``e8m0``): ``a`` (M, K) and ``b`` (K, N), both
        ``torch.float8_e4m3fn`` with K a multiple of 32; ``a_scale`` (M, K/32) and ``b_scale``
        (N, K/32), ``torch.uint8`` E8M0 bytes, one per 32 elements along K (byte ``s`` means
        ``2**(s - 127)``, 0 is ``2**-127``, 255 is NaN). Returns ``dequant(a) @ dequant(b)`` as an
        (M, N) tensor of ``out_dtype`` (float32, bfloat16 or float16). Must run under
        ``torch.compile(fullgraph=True)`` as one call of :meth:`e8m0_op` that no e8m0 dtype crosses;
        a bad argument raises an exception whose message names it (`a`, `b`, `a_scale`, `b_scale`).
        Scales given as ``torch.float8_e8m0fnu`` may be refused the same way, or read as the same
        bytes as their ``uint8`` view, never by value (E8M0-006)."""
        raise NotImplementedError(f"backend {self.name!r} does not implement scaled_mm_e8m0()")

    def e8m0_op(self):
        """The ``torch._ops.OpOverload`` that :meth:`scaled_mm_e8m0` calls (capability ``e8m0``), with
        the same arguments: the suite runs ``torch.library.opcheck`` on it, looks for it in
        compiled graphs, and counts its calls (any overload) with two FP8 matrix operands as FP8
        compute in the backend's graphs."""
        raise NotImplementedError(f"backend {self.name!r} does not implement e8m0_op()")

    def __repr__(self) -> str:
        return f"<fp8conf backend {self.name!r} {self.version} capabilities={sorted(self.capabilities)}>"

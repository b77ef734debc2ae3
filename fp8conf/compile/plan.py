"""The first stage of a compile: what compiling a graph takes, read from it once.

:func:`plan_compile` takes the graph :func:`~fp8conf.compile.joint.compile_joint` was given, its
:class:`~fp8conf.CompileConfig` and example inputs, and hands on a :class:`JointPlan`: the graph
validated (strict compilation compiles only what strict validation accepts), its joint signature,
the names of its op nodes, the flat copy (placeholders in, a flat list out) that the later stages
cut and compile and, for ``regional``, its FP8 regions, identified once; for ``full``, a sharded
step is refused. Inductor's pool of kernel-compiling processes is started on the way, so that its
start overlaps the next stage, the cut (:func:`~fp8conf.compile.partition.partition_plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import torch
import torch.fx

from fp8conf import errors
from fp8conf.compile.config import CompileConfig
from fp8conf.graph.regions import Region, check_attributed, identify_fp8_regions
from fp8conf.graph.trace import flat_graph_module, joint_signature, trace_info
from fp8conf.graph.validate import validate_fp8_graph
from fp8conf.log import library_notices_quieted

__all__ = ["JointPlan", "plan_compile"]


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """The first stage of a compile (:func:`plan_compile`): what compiling ``gm`` takes, read from
    it once and handed on.

    Attributes:
        gm: the graph compiled (never changed).
        config: the compile's settings.
        example_inputs: what ``full`` specializes to (``None``: the traced values).
        signature: ``gm``'s :class:`~fp8conf.JointSignature` (``None`` for a graph fp8conf did not
            trace): the cut, the compiled halves and the input check all read it.
        names: the names of ``gm``'s op nodes, each compiled or left eager.
        flat: a flat copy of ``gm`` (:func:`~fp8conf.graph.trace.flat_graph_module`), what the
            later stages cut and compile.
        regions: the FP8 regions of ``flat`` (``regional``), identified once: the cut keeps them
            whole, and each half is tagged with its share of them.
    """

    gm: torch.fx.GraphModule
    config: CompileConfig
    example_inputs: Any
    signature: Any
    names: frozenset[str]
    flat: torch.fx.GraphModule
    regions: list[Region] = dataclasses.field(default_factory=list)

    @property
    def takes_inputs(self) -> bool:
        return bool(self.flat.graph.find_nodes(op="placeholder"))


def plan_compile(gm: torch.fx.GraphModule, config: CompileConfig, example_inputs=None) -> JointPlan:
    """The first stage: ``gm`` validated (strict compilation compiles only what strict validation
    accepts), its signature read, its flat copy made and, for ``regional``, its FP8 compute
    checked for attribution and its regions identified; for ``full``, a sharded step refused."""
    if config.strict:
        _validate_first(gm)
    _warm_compile_pool(gm)
    signature = joint_signature(gm)
    names = frozenset(n.name for n in gm.graph.nodes if n.op == "call_function")
    plan = JointPlan(gm, config, example_inputs, signature, names, flat_graph_module(gm))
    if not plan.takes_inputs:
        return plan
    if config.mode == "full":
        _refuse_collectives(plan.flat)
        return plan
    # Before the cut: FP8 compute no region can hold would otherwise be compiled as no region
    # at all, and the partitioner cannot read nodes without meta["val"].
    check_attributed(plan.flat, strict=config.strict)
    return dataclasses.replace(plan, regions=identify_fp8_regions(plan.flat))


def _validate_first(gm: torch.fx.GraphModule) -> None:
    """Strict compilation compiles only what strict validation accepts. A graph without fp8conf's
    trace information (built or cut by someone else) cannot be validated; its FP8 compute is still
    checked for attribution (regions) and the skipped validation is said."""
    if trace_info(gm) is not None:
        validate_fp8_graph(gm, strict=True)
    else:
        from fp8conf.log import logger

        logger.info("fp8conf: compile_joint(strict=True) of a graph without fp8conf trace information (gm.meta['fp8conf_trace']): "
                    "validation skipped; only the attribution of its FP8 compute is checked")


def _warm_compile_pool(gm: torch.fx.GraphModule) -> None:
    """Start Inductor's pool of kernel-compiling processes now, as ``torch.compile`` does when it
    first hands a graph to Inductor. Left alone, the pool starts at the first Triton kernel, and
    until its processes have imported torch, Inductor compiles the kernels one by one in this
    process (7 s of a regional first step on an H200). The processes start while the joint graph
    is cut and its regions tagged. Without Triton (on CPU) there is no pool; for a graph on the
    CPU, :func:`_warm_cpu_codegen` does the same for C++ kernels."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
    with library_notices_quieted():  # Inductor's first import meets torch.jit's deprecation
        import torch._inductor.compile_fx  # noqa: F401
    if any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cpu"
           for n in gm.graph.find_nodes(op="placeholder")):
        _warm_cpu_codegen()


@functools.cache  # once per process
def _warm_cpu_codegen() -> None:
    """Find the CPU's vector instruction set now, in a thread, while this one cuts the graph.

    Inductor asks for it at its first C++ kernel (``cpu_vec_isa.pick_vec_isa``) and answers by
    building and loading a test library per instruction set with the C++ compiler: about 7 s of a
    fresh process's first regional step on a 2-core machine, the cut meanwhile (10 s at 32
    blocks) being Python's work alone. The answer is cached by Inductor. What
    fails here fails again, and is reported, where Inductor asks."""
    from fp8conf.log import logger
    from fp8conf.torch_internals import probe

    found = probe("torch._inductor.cpu_vec_isa.pick_vec_isa")
    if not found.found:  # `fp8conf doctor` lists this fast path as off, with the reason
        logger.info("fp8conf: the CPU's instruction set is found at Inductor's first C++ kernel: %s", found.reason)
        return

    def find() -> None:
        try:
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            pick_vec_isa()
        except Exception as exc:  # Inductor's own call meets it again and says it
            logger.info("fp8conf: finding the CPU's vector instruction set ahead of Inductor failed: %r", exc)

    threading.Thread(target=find, name="fp8conf-cpu-vec-isa", daemon=True).start()


def _refuse_collectives(gm: torch.fx.GraphModule) -> None:
    """A sharded step (collectives in the graph, a process group among its inputs) is not compiled
    whole: say so, and what works, before Inductor meets its process-group inputs."""
    from fp8conf.graph.collectives import is_collective

    found = [n for n in gm.graph.nodes if is_collective(n)]
    if found:
        kinds = sorted({str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target) for n in found})
        raise errors.FP8ConfigError(
            f"compile_joint(mode='full'): the graph is a sharded step ({len(found)} collectives: {', '.join(kinds)}; "
            f"first {found[0].name!r}), and a fully compiled sharded step is not supported; compile it with "
            "mode='regional', where the collectives run between the compiled FP8 regions"
        )

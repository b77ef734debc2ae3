"""What the suite reads from a backend's sharded steps (capability ``distributed``), independently
of the backend.

* :func:`fake_mesh`: a one-dimensional ``DeviceMesh`` over torch's fake process group
  (``torch.testing._internal.distributed.fake_pg``), as any rank of any world size, in this one
  process: collectives trace with their shapes and dtypes and move nothing. The structural
  properties (DP-001, DP-002, DP-004) read graphs traced over it.
* :func:`weight_gathers`: the forward all-gathers that move a quantized module's weight, found by
  data flow in the backend's own graph: the all-gathers among the ancestors of the weight operand
  of the module's forward matmuls (the module as the suite's own ground truth says,
  :func:`conformance.observe.graphs.trace_with_oracle`). The all-gathers are torch's functional
  collectives (``torch.ops._c10d_functional``) or their ``c10d`` forms, whatever code issued them.
* :func:`moves_fp8_bytes` / :func:`only_views_between`: what such a gather moves.
* :func:`gloo_gradients`: the data-parallel step run by the backend in processes of their own
  over gloo (DP-003), against the unsharded eager step; ranks that cannot connect are the
  machine's problem (:class:`conformance.run.environment.EnvironmentProblem`), not the backend's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import operator
import os
import tempfile

import torch
import torch.fx

from conformance.run.environment import GLOO_START_FAILED, EnvironmentProblem, gloo_fix, gloo_start_evidence
from conformance.observe.graphs import Fp8Ops, is_fp8_compute, is_fp8_dtype
from fp8contract.rank_processes import start_ranks

__all__ = [
    "WORLD_SIZE",
    "fake_mesh",
    "is_all_gather",
    "WeightGather",
    "weight_gathers",
    "weight_operand",
    "forward_matmuls",
    "moves_fp8_bytes",
    "only_views_between",
    "descendants",
    "GlooCase",
    "gloo_gradients",
    "DP_GRADIENT_TOLERANCE",
]

#: The world size of every sharded step the suite draws.
WORLD_SIZE = 2
#: DP-003: relative norm of the difference between the sharded step's gradients and the mean of
#: the unsharded step's over the ranks' parts of the batch, float32 rounding of the reduction
#: (a weight's FP8 scale is that of the whole weight, an activation's that of the rank's part, in
#: both). Summing instead of averaging is off by 1; a scale taken from a rank's shard of the
#: weight instead of the whole weight by FP8 rounding, around 1e-2.
DP_GRADIENT_TOLERANCE = 1e-5

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")
# Matmul ops and the index of the operand a linear layer passes its weight as (x @ W.T).
_WEIGHT_OPERAND = {
    "aten.mm": 1, "aten.matmul": 1, "aten.bmm": 1, "aten.linear": 1, "aten.addmm": 2,
    "aten._scaled_mm": 1, "aten._scaled_mm_v2": 1,
}
# Ops that move bytes without computing on them: views, layout copies, splits, waits.
_VIEWS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute", "aten.detach",
    "aten.alias", "aten.clone", "aten.contiguous", "aten.expand", "aten.as_strided", "aten.slice", "aten.narrow",
    "aten.split", "aten.split_with_sizes", "aten.split_with_sizes_copy", "aten.chunk", "aten.unsqueeze", "aten.squeeze",
    "aten.select", "aten.unbind", "aten.lift_fresh_copy", "aten._to_copy", "aten.copy",
    "_c10d_functional.wait_tensor", "_c10d_functional_autograd.wait_tensor",
})


@contextlib.contextmanager
def fake_mesh(rank: int = 0, world_size: int = WORLD_SIZE):
    """A one-dimensional CPU ``DeviceMesh`` over torch's fake process group, as ``rank``; the
    group is destroyed on exit. A process group set up already in this process is an error: the
    suite's fake one would replace it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is initialized already in the suite's process; the DP properties trace "
            "over a fake process group of their own: run them in a process that has none"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _name(node: torch.fx.Node) -> str:
    """``namespace.op`` of a call, without the overload (``aten.view``, ``_c10d_functional.wait_tensor``)."""
    if node.target is operator.getitem:
        return "getitem"
    packet = getattr(node.target, "overloadpacket", None)
    return str(packet) if packet is not None else str(node.target)


def is_all_gather(node: torch.fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", None)
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and namespace in _COLLECTIVE_NAMESPACES and ("all_gather" in name or "allgather" in name)


def _dtype(node) -> torch.dtype | None:
    return getattr(node.meta.get("val") if isinstance(node, torch.fx.Node) else None, "dtype", None)


def _keeps_bytes(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = _name(node)
    if name == "getitem":
        return True
    if name not in _VIEWS:
        return False
    if name in ("aten._to_copy", "aten.copy"):  # a copy that converts is arithmetic
        source = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        return _dtype(source) == _dtype(node)
    return True


def descendants(node: torch.fx.Node) -> set:
    found, stack = set(), list(node.users)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.users)
    return found


def _ancestors(node: torch.fx.Node) -> set:
    found, stack = {node}, list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def forward_matmuls(gm: torch.fx.GraphModule, oracle, is_backward, ops: Fp8Ops) -> dict[str, list[torch.fx.Node]]:
    """Module FQN -> its forward matmul nodes (FP8 compute, or a high-precision matmul), by the
    suite's ground truth of which module issued each node."""
    found: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_backward(node):
            continue
        module = oracle.issued_by.get(node)
        if module is not None and (is_fp8_compute(node, ops) or _name(node) in _WEIGHT_OPERAND):
            found.setdefault(module, []).append(node)
    return found


def weight_operand(matmul: torch.fx.Node):
    index = _WEIGHT_OPERAND.get(_name(matmul), 1)
    value = matmul.args[index] if len(matmul.args) > index else None
    return value if isinstance(value, torch.fx.Node) else None


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """A forward all-gather whose result reaches ``matmul``'s weight operand."""

    gather: torch.fx.Node
    matmul: torch.fx.Node
    operand: torch.fx.Node

    @property
    def wire_dtype(self):
        return _wire_dtype(self.gather)

    def describe(self) -> str:
        dtype = self.wire_dtype
        size = dtype.itemsize if isinstance(dtype, torch.dtype) else "?"
        return f"all-gather '{self.gather.name}' ({self.gather.target}) moving {dtype}, {size} byte(s) per element, into matmul '{self.matmul.name}'"


def _wire_dtype(gather: torch.fx.Node):
    """The dtype of what an all-gather sends: its input's, or else its result's."""
    value = gather.args[0] if gather.args else None
    return _dtype(value) or _dtype(gather)


def weight_gathers(matmuls: list[torch.fx.Node], is_backward) -> list[WeightGather]:
    """The forward all-gathers among the ancestors of each matmul's weight operand."""
    found = []
    for matmul in matmuls:
        operand = weight_operand(matmul)
        if operand is None:
            continue
        for node in _ancestors(operand):
            if is_all_gather(node) and not is_backward(node):
                found.append(WeightGather(node, matmul, operand))
    return found


def only_views_between(gather: torch.fx.Node, operand: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes on the paths from ``gather`` to ``operand`` that compute on the bytes (empty:
    only views, waits and copies that keep the dtype)."""
    between = (descendants(gather) & _ancestors(operand)) | {operand}
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    return sorted((n for n in between if n is not gather and not _keeps_bytes(n)), key=order.__getitem__)


def casts_after(gather: torch.fx.Node, operand: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes on the paths from ``gather`` to ``operand`` (``operand`` included) that make FP8
    from a high-precision input: the casts that quantize the gathered weight."""
    between = (descendants(gather) & _ancestors(operand)) | {operand}
    return [n for n in between if is_fp8_dtype(_dtype(n))
            and any(not is_fp8_dtype(_dtype(a)) and (_dtype(a) or torch.int8).is_floating_point for a in n.all_input_nodes)]


def moves_fp8_bytes(gather: torch.fx.Node) -> bool:
    """The gather moves FP8: its wire dtype is FP8, or it moves one-byte integers viewed from an
    FP8 value before the gather or viewed as one after it (through byte-keeping ops only)."""
    wire = _wire_dtype(gather)
    if is_fp8_dtype(wire) or is_fp8_dtype(_dtype(gather)):
        return True
    if not isinstance(wire, torch.dtype) or wire.itemsize != 1:
        return False
    back = _reaches_fp8(gather.all_input_nodes, lambda n: n.all_input_nodes)  # to where the bytes came from
    return back or _reaches_fp8(gather.users, lambda n: n.users)  # to what they are read as


def _reaches_fp8(start, step) -> bool:
    """Whether an FP8 value lies among ``start`` or beyond them along ``step``, through
    byte-keeping ops only."""
    stack, seen = list(start), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_fp8_dtype(_dtype(node)):
            return True
        if _keeps_bytes(node):
            stack.extend(step(node))
    return False


# -- DP-003: the data-parallel step over gloo ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GlooCase:
    """One model of DP-003: its spec (``conformance.draw.models.ModelSpec``), the setting, and whether
    the backend's own float8 linears (``Backend.convert_float8``) are built, not TorchAO's."""

    spec: object
    float8_all_gather: bool
    own_modules: bool = False


def _unsharded_gradients(model, x, g) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    model(x).backward(g)
    return {fqn: p.grad.detach().clone() for fqn, p in model.named_parameters()}


def _whole(grad, full_shape, world):
    """The whole gradient from what ``run_joint`` gave: itself, a ``DTensor``, or a dim-0 shard."""
    import torch.distributed as dist

    if hasattr(grad, "full_tensor"):
        return grad.full_tensor()
    if tuple(grad.shape) == tuple(full_shape):
        return grad
    if grad.dim() and grad.shape[0] * world == full_shape[0]:
        whole = torch.empty(full_shape, dtype=grad.dtype)
        dist.all_gather_into_tensor(whole, grad.contiguous())
        return whole
    raise ValueError(f"a gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(full_shape)}: neither whole nor a dim-0 shard")


def _gloo_case(backend, mesh, rank, world, case) -> dict:
    import copy

    from conformance.run.harness import grad_outputs
    from conformance.draw.models import build_model

    if case.own_modules:
        model, (x,) = build_model(case.spec, "cpu", float8=backend.convert_float8)
    else:
        model, (x,) = build_model(case.spec, "cpu", float8_all_gather=case.float8_all_gather)
    (g,) = grad_outputs(case.spec, 1, "cpu")
    rows = x.shape[0] // world
    halves = [(x.detach()[r * rows:(r + 1) * rows].clone().requires_grad_(x.requires_grad), g[r * rows:(r + 1) * rows].clone())
              for r in range(world)]
    # What averaging data-parallel gradients means: the mean, over the ranks, of the unsharded
    # step's gradients on each rank's part of the batch. Each part is cast to FP8 with its own
    # amax there too, so FP8 rounding is the same as on the ranks.
    parts = [_unsharded_gradients(copy.deepcopy(model), xr, gr) for xr, gr in halves]
    expected = {fqn: sum(p[fqn] for p in parts) / world for fqn in parts[0]}
    shapes = {fqn: p.shape for fqn, p in model.named_parameters()}
    sharded = backend.shard_data_parallel(model, mesh, float8_all_gather=case.float8_all_gather)
    mine, grad_out = halves[rank]
    gm = backend.trace_joint(sharded, (mine,))
    _, grads = backend.run_joint(gm, sharded, (mine,), (grad_out,))
    errors = {}
    for fqn in sorted(shapes):
        if fqn not in grads:
            errors[fqn] = "missing"
            continue
        whole = _whole(grads[fqn].detach(), shapes[fqn], world)
        errors[fqn] = float((whole - expected[fqn]).norm() / expected[fqn].norm().clamp_min(1e-12))
    return errors


def _gloo_worker(rank, world, init_file, backend_class, cases, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
    except Exception as exc:  # said so that the parent tells the machine's failure from the backend's
        raise RuntimeError(f"rank {rank}: {GLOO_START_FAILED}: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    try:
        backend = backend_class()
        mesh = init_device_mesh("cpu", (world,))
        results = []
        for case in cases:
            try:
                results.append(("ok", _gloo_case(backend, mesh, rank, world, case)))
            except Exception as exc:  # reported per case; the other rank fails the same way
                results.append(("error", f"{type(exc).__name__}: {exc}"))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    _leave_rank()


def _leave_rank() -> None:
    """End a spawned rank whose results are saved without the interpreter's teardown: gloo's
    threads sometimes abort it ("terminate called without an active exception", SIGABRT), which
    the parent would take for a failed rank, and the property for a failure of the backend."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@functools.lru_cache(maxsize=8)
def gloo_gradients(backend_class: type, cases: tuple[GlooCase, ...], world: int = WORLD_SIZE) -> tuple:
    """Per case and rank, ``("ok", {parameter FQN: relative error})`` or ``("error", message)``:
    the backend's sharded step in ``world`` gloo processes (:func:`~fp8contract.rank_processes.start_ranks`, one CPU thread each) against
    the unsharded eager step. Run once per backend class and cases in a session.

    Raises :class:`~conformance.run.environment.EnvironmentProblem` when a rank's process group did
    not start or its sockets failed (the machine's network setup, not the backend), naming what
    the rank said."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            start_ranks(_gloo_worker, (world, init_file, backend_class, cases, tmp), nprocs=world,
                        preload=(__name__, backend_class.__module__))
        except mp.ProcessRaisedException as exc:
            evidence = gloo_start_evidence(str(exc))
            if evidence is None:
                raise
            raise EnvironmentProblem(f"the {world} gloo processes could not connect", evidence=evidence,
                                     fix=gloo_fix(evidence)) from None
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    return tuple(tuple(rank[i] for rank in per_rank) for i in range(len(cases)))

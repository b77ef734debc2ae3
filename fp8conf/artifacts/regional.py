"""Regionally compiled graphs in an artifact: the joint graph, or the three GraphPP callables.

Regional compilation (:func:`fp8conf.compile_joint`, ``mode="regional"``) is the mode whose
point is a short cold start, so its result can be saved too. What it returns (unpartitioned)
is a flat graph in which every compiled FP8 region is one call of an
``AOTCompiledArtifact`` (Inductor's generated code for that region), and so is every compiled
piece of the remainder between them (``remainder="inductor"``), the rest running eagerly; ``torch.fx._graph_pickler.GraphPickler`` serializes exactly that graph, with
each region's compiled code. An artifact of mechanism ``regional`` holds one such graph per
part (``joint``, or ``forward`` / ``backward_input`` / ``backward_weight`` for a split) and
records, per part, the identity of each compiled region (id, module, pass, nodes). Loading
deserializes the graphs and compiles nothing (on CPU the C++ compiler still builds the bundled
kernel sources into a library when Inductor's cache does not already hold it, as for ``full``
artifacts), then checks that no node of a recorded region runs eagerly.

The same format, digest, MAC and fingerprint checks apply as to every artifact (see
:mod:`fp8conf.artifacts.store`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from fp8conf.artifacts.format import FORMAT_VERSION, ArtifactHeader, seal, write_atomic
from fp8conf.artifacts.signature import QuantizationSignature
from fp8conf.errors import ArtifactError, FP8ConfigError

__all__ = ["PrecompiledSplit", "save_split_artifact", "load_split_artifact"]


# --- one part: a regionally compiled flat graph ---------------------------------------------------


def region_specs(compiled) -> list[dict]:
    """The identity of each region ``compiled`` (a :class:`~fp8conf.CompiledJoint`) compiled."""
    return [
        {"id": r.id, "module_fqn": r.module_fqn, "pass_name": r.pass_name, "nodes": sorted(n.name for n in r.nodes)}
        for r in compiled.regions
        if r.complete
    ]


def pack_part(name: str, graph, regions: list[dict], path: str) -> tuple[bytes, dict]:
    """``(bytes, part entry)`` of one regionally compiled flat graph (a
    :class:`~fp8conf.CompiledJoint`'s ``artifact``, or the graph itself when it has no input and
    nothing was compiled) whose compiled regions are ``regions``."""
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        # Every op may be pickled by name (fp8conf's own ops too); each region's
        # AOTCompiledArtifact is serialized with its generated code.
        data = GraphPickler.dumps(graph, Options(ops_filter=None))
    except Exception as exc:
        raise ArtifactError(
            f"cannot save the regionally compiled {name} graph in {path!r}: {type(exc).__name__}: {exc}. "
            "Its regions must be compiled by fp8conf.compile_joint(mode='regional') of this fp8conf.",
            path=path,
        ) from exc
    return data, {"name": name, "size": len(data), "regions": regions}


def unpack_parts(payload: bytes, header: ArtifactHeader, path: str) -> dict[str, Callable]:
    """Each part's graph, deserialized, checked and callable on flat inputs."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fns, offset = {}, 0
    for part in header.parts:
        data = payload[offset:offset + part["size"]]
        offset += part["size"]
        graph = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
        graph.recompile()
        _check_regions_compiled(graph, part, path)
        fns[part["name"]] = flat_callable(graph)
    return fns


def _check_regions_compiled(graph, part: dict, path: str) -> None:
    eager = {n.name for n in graph.graph.nodes if n.op == "call_function"}
    for region in part["regions"]:
        left = sorted(eager.intersection(region["nodes"]))
        if left:
            raise ArtifactError(
                f"artifact {path!r}: FP8 region {region['id']} of module '{region['module_fqn']}' ({region['pass_name']} pass) "
                f"of the {part['name']} graph runs eagerly after loading (nodes {left[:5]}); re-save the artifact",
                path=path,
            )


def flat_callable(graph) -> Callable:
    """``graph`` (a regionally compiled flat graph) called on flat inputs."""
    import torch

    if isinstance(graph.graph._codegen, getattr(torch.fx.graph, "_BoxedCodeGen", ())):
        return lambda *flat: graph(list(flat))  # a boxed graph takes one list
    return graph


# --- GraphPP: the three callables of a stage ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrecompiledSplit:
    """A stage's forward, backward-input and backward-weight callables loaded from an artifact.

    ``fns`` maps each part's name to its compiled callable (flat inputs, as
    :class:`~fp8conf.StageSplit`'s parts); ``layout`` is a :class:`~fp8conf.StageSplit` whose parts
    are those callables, so its ``run_forward``, ``run_backward_input``, ``run_backward_weight``
    and ``run`` work as on the split that was saved. ``regions`` lists, per part, the compiled
    regions' identities; ``signature`` is the quantization signature it was loaded with.
    """

    fns: dict
    layout: object
    regions: dict
    joint_signature: object
    signature: QuantizationSignature | None = None

    def run(self, primals: Sequence, tangents: Sequence) -> list:
        """The joint graph's flat outputs, as :meth:`fp8conf.StageSplit.run` returns them."""
        import torch

        with torch.no_grad():
            return self.layout.run([p.detach() for p in primals], [t.detach() for t in tangents])

    def run_model(self, model, args, grad_outputs) -> tuple[tuple, dict]:
        """``(outputs, grads)`` for ``model``'s current parameters, as :func:`fp8conf.run_joint` returns them."""
        primals, tangents = self.joint_signature.feed(model, args, grad_outputs)
        return self.joint_signature.results(self.run(primals, tangents))


def _split_layout(split) -> dict:
    return {
        "num_outputs": split.num_outputs,
        "saved_for_input": list(split.saved_for_input),
        "saved_for_weight": list(split.saved_for_weight),
        "input_grads": list(split.input_grads),
        "param_grads": list(split.param_grads),
        "output_layout": [None if slot is None else list(slot) for slot in split.output_layout],
    }


def save_split_artifact(path, gm, split, signature: QuantizationSignature, fns: dict | None = None, *, key=None,
                        unsigned: bool = False) -> ArtifactHeader:
    """Save the GraphPP split ``split`` of the joint graph ``gm`` (:func:`fp8conf.split_stage`),
    its callables regionally compiled, with ``signature`` at ``path``, signed as
    :func:`fp8conf.save_artifact` signs. ``fns`` is what ``fp8conf.compile_split(split,
    mode="regional")`` returned (compiled here when omitted)."""
    import fp8conf
    from fp8conf.artifacts.store import _check_signature_describes, _describe, _signing_key
    from fp8conf.graph.split import StageSplit, compile_split
    from fp8conf.graph.trace import trace_info

    path = os.fspath(path)
    if not isinstance(split, StageSplit):
        raise FP8ConfigError(f"save_split_artifact: expected a StageSplit from fp8conf.split_stage, got {type(split).__qualname__}")
    if not isinstance(signature, QuantizationSignature):
        raise FP8ConfigError(f"save_split_artifact: signature must be a QuantizationSignature, got {type(signature).__qualname__}")
    signing_key = _signing_key(key, unsigned, path)
    info = trace_info(gm)
    _check_signature_describes(signature, info.modules if info else None, path)
    inputs, outputs = _describe(gm)
    fns = fns if fns is not None else compile_split(split, mode="regional")
    wrong = sorted(name for name, fn in fns.items() if getattr(fn, "mode", None) != "regional")
    if set(fns) != set(split.parts) or wrong:
        raise FP8ConfigError(
            f"save_split_artifact: fns must be compile_split(split, mode='regional')'s result; got parts {sorted(fns)}"
            + (f", {wrong} not regionally compiled" if wrong else "")
        )
    packed = [pack_part(name, _graph_of(fns[name]), region_specs(fns[name]), path) for name in split.parts]
    header = ArtifactHeader(
        FORMAT_VERSION, "regional", signature, signature.sha256, sum(len(d) for d, _ in packed), inputs, outputs,
        fp8conf.__version__, parts=[entry for _, entry in packed], split=_split_layout(split),
    )
    header, data = seal(header, b"".join(d for d, _ in packed), signing_key)
    write_atomic(path, data)
    return header


def _graph_of(compiled):
    """The flat graph a regional :class:`~fp8conf.CompiledJoint` runs (the part itself when it
    has no input and nothing was compiled)."""
    if compiled.artifact is not None:
        return compiled.artifact
    from fp8conf.graph.trace import flat_graph_module

    return flat_graph_module(compiled.fn)


def load_split_artifact(path, expected_signature: QuantizationSignature, *, key=None, trust_unsigned: bool = False) -> PrecompiledSplit:
    """Load a split saved by :func:`save_split_artifact`, after the checks of
    :func:`fp8conf.load_artifact` (digest, MAC, fingerprint); nothing is compiled."""
    from fp8conf.artifacts.store import _deserialize_guarded, _verified
    from fp8conf.graph.split import StageSplit

    path = os.fspath(path)
    header, payload = _verified(path, expected_signature, key, trust_unsigned)
    if header.split is None:
        raise ArtifactError(f"artifact {path!r} holds a {header.mechanism} joint graph, not a GraphPP split; load it with fp8conf.load_artifact", path=path)
    fns = _deserialize_guarded(path, header, lambda: unpack_parts(payload, header, path))
    layout = header.split
    stage = StageSplit(
        fns["forward"], fns["backward_input"], fns["backward_weight"], layout["num_outputs"],
        tuple(layout["saved_for_input"]), tuple(layout["saved_for_weight"]), tuple(layout["input_grads"]),
        tuple(layout["param_grads"]), tuple(None if slot is None else tuple(slot) for slot in layout["output_layout"]),
    )
    from fp8conf.artifacts.store import _signature_of_header

    joint = _signature_of_header(header.inputs, header.outputs)
    return PrecompiledSplit(fns, stage, {p["name"]: p["regions"] for p in header.parts}, joint, header.signature)

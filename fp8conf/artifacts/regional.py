"""Regionally compiled graphs in an artifact: the joint graph, or the three GraphPP callables.

Regional compilation (:func:`fp8conf.compile_joint`, ``mode="regional"``) is the mode whose
point is a short cold start, so its result can be saved too. What it returns (unpartitioned)
is a flat graph that calls compiled units (Inductor's generated code): one
per unit of regions and the remainder around them (``remainder="inductor"``), or per region and
per piece of the remainder between them (``"pieces"``, ``"eager"``); the rest runs eagerly. Structurally equal regions share one compiled object, so a deep model calls few
compiled pieces from many call sites: the artifact stores each distinct piece once (keyed by the
object, then by the sha256 of its serialized bytes), in a table after the graphs, and each call
site of the pickled graph (``torch.fx._graph_pickler.GraphPickler``) calls a stand-in submodule
naming its piece. Any call of an ``AOTCompiledArtifact`` counts as a piece, whatever the
regional compile made it for; a unit the compile made with Inductor's inner compiler
(a :class:`~fp8conf.compile.CompiledUnit`, which cannot be serialized) is
compiled once more, by ``standalone_compile``, and stored in that form (the same kernels).
:func:`fp8conf.precompile_joint` and :func:`save_split_artifact` without ``fns`` compile every unit
in that form from the start. An artifact of mechanism ``regional`` holds one such graph per
part (``joint``, or ``forward`` / ``backward_input`` / ``backward_weight`` for a split; the parts
share the table) and records, per part, the identity of each compiled region (id, module, pass,
nodes). Loading deserializes each piece once, puts it back at its call sites, and compiles nothing (on CPU the C++ compiler still builds the bundled
kernel sources into a library when Inductor's cache does not already hold it, as for ``full``
artifacts), then checks that no node of a recorded region runs eagerly.

The same format, digest, MAC and fingerprint checks apply as to every artifact (see
:mod:`fp8conf.artifacts.store`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence

import torch

from fp8contract.writing import check_write_target
from fp8conf.artifacts.envelope import (
    check_signature_describes, describe_graph, deserialize_guarded, resolve_signing_key, signature_of_header, verified,
)
from fp8conf.artifacts.format import FORMAT_VERSION, ArtifactHeader, seal, write_atomic
from fp8conf.artifacts.signature import QuantizationSignature
from fp8conf.errors import ArtifactError, ArtifactIntegrityError, FileWriteError, FP8ConfigError
from fp8conf.log import logger

__all__ = ["PrecompiledSplit", "save_split_artifact", "load_split_artifact"]


# --- one part: a regionally compiled flat graph ---------------------------------------------------


def region_specs(compiled) -> list[dict]:
    """The identity of each region ``compiled`` (a :class:`~fp8conf.CompiledJoint`) compiled."""
    return [
        {"id": r.id, "module_fqn": r.module_fqn, "pass_name": r.pass_name, "nodes": sorted(n.name for n in r.nodes)}
        for r in compiled.regions
        if r.complete
    ]


#: Prefix of the stand-in submodules a packed graph calls in place of its compiled pieces.
PIECE_PREFIX = "fp8conf_piece_"


class _PieceRef(torch.nn.Module):
    """Stands, in a packed graph, for the compiled piece ``index`` of the artifact's piece table;
    loading puts the piece itself back in its place before the graph runs."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise ArtifactError(f"compiled piece {self.index} of a regional artifact was called before it was loaded; load the artifact with fp8conf")


def _compiled_piece(target):
    """The ``AOTCompiledArtifact`` a call_function target runs (a compiled region, or any other
    compiled piece of a regional graph), or ``None``."""
    try:
        from torch._inductor.standalone_compile import AOTCompiledArtifact
    except ImportError as exc:  # a torch without it has no such pieces to find
        logger.debug("regional artifacts: %r; no AOTCompiledArtifact pieces to find", exc)
        return None
    from fp8conf.compile import CompiledUnit

    artifact = getattr(target, "__wrapped__", None)
    if isinstance(artifact, CompiledUnit):
        return artifact.saveable()  # compiled again, once, in the form an artifact stores
    return artifact if isinstance(artifact, AOTCompiledArtifact) else None


class _PieceTable:
    """The distinct compiled pieces of the graphs being packed, each serialized once: call sites
    of one compiled object share its entry, and so do pieces whose bytes are equal."""

    def __init__(self):
        self.blobs: list[bytes] = []
        self._by_object: dict[int, int] = {}
        self._by_digest: dict[str, int] = {}
        self._alive: list = []  # keeps every object whose id() is a key alive while packing

    def index(self, artifact) -> int:
        if id(artifact) not in self._by_object:
            data = artifact.serialize()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in self._by_digest:
                self._by_digest[digest] = len(self.blobs)
                self.blobs.append(data)
            self._by_object[id(artifact)] = self._by_digest[digest]
            self._alive.append(artifact)
        return self._by_object[id(artifact)]

    def entries(self) -> list[dict]:
        return [{"sha256": hashlib.sha256(b).hexdigest(), "size": len(b)} for b in self.blobs]


def _with_piece_refs(graph, table: _PieceTable):
    """A copy of ``graph`` whose calls of compiled pieces call :class:`_PieceRef` stand-ins, so
    that pickling it stores no compiled code (the table holds it, once per piece)."""
    from fp8conf.graph.trace import copy_graph_module

    packed = copy_graph_module(graph)
    for target in dict.fromkeys(n.target for n in packed.graph.nodes if n.op == "call_module"):
        inner = packed.get_submodule(target)
        if isinstance(inner, torch.fx.GraphModule):  # a piece cut out as a submodule: packed alike, in a copy
            packed.add_submodule(target, _with_piece_refs(inner, table))
    for node in [n for n in packed.graph.nodes if n.op == "call_function"]:
        artifact = _compiled_piece(node.target)
        if artifact is None:
            continue
        index = table.index(artifact)
        name = f"{PIECE_PREFIX}{index}"
        if not hasattr(packed, name):
            packed.add_submodule(name, _PieceRef(index))
        node.op, node.target = "call_module", name  # in place: node names stay what the header records
    packed.recompile()
    return packed


def pack_parts(parts: Sequence[tuple[str, object, list[dict]]], path: str) -> tuple[bytes, list[dict], list[dict]]:
    """``(payload, part entries, piece entries)`` of regionally compiled flat graphs, given as
    ``(name, graph, regions)``: each a :class:`~fp8conf.CompiledJoint`'s ``artifact`` (or the graph
    itself when it has no input and nothing was compiled) whose compiled regions are ``regions``.
    The payload is each part's pickled graph, then each distinct compiled piece once."""
    from torch.fx._graph_pickler import GraphPickler, Options

    table, blobs, entries = _PieceTable(), [], []
    for name, graph, regions in parts:
        try:
            # Every op may be pickled by name (fp8conf's own ops too); compiled pieces go to the table.
            data = GraphPickler.dumps(_with_piece_refs(graph, table), Options(ops_filter=None))
        except Exception as exc:
            raise ArtifactError(
                f"cannot save the regionally compiled {name} graph in {path!r}: {type(exc).__name__}: {exc}. "
                "Its regions must be compiled by fp8conf.compile_joint(mode='regional') of this fp8conf.",
                path=path,
            ) from exc
        blobs.append(data)
        entries.append({"name": name, "size": len(data), "regions": regions})
    return b"".join(blobs + table.blobs), entries, table.entries()


def unpack_parts(payload: bytes, header: ArtifactHeader, path: str) -> dict[str, torch.fx.GraphModule]:
    """Each part's graph, deserialized, its compiled pieces loaded once each, and checked (call
    it on flat inputs through :func:`flat_callable`)."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    offset = sum(part["size"] for part in header.parts)
    pieces = _load_pieces(payload[offset:], header.pieces, path)
    graphs, offset = {}, 0
    for part in header.parts:
        data = payload[offset:offset + part["size"]]
        offset += part["size"]
        graph = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
        _bind_pieces(graph, pieces, part["name"], path)
        _check_regions_compiled(graph, part, path)
        graphs[part["name"]] = graph
    return graphs


def _load_pieces(data: bytes, entries: list[dict], path: str) -> list[Callable]:
    """Each compiled piece deserialized once, as the plain function FX code calls."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    pieces, offset = [], 0
    for i, entry in enumerate(entries):
        blob = data[offset:offset + entry["size"]]
        offset += entry["size"]
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:  # the header is authenticated: the bytes must be its
            raise ArtifactIntegrityError(f"artifact {path!r}: compiled piece {i} does not match its sha256 in the header; save it again", path=path)
        pieces.append(_piece_call(AOTCompiledArtifact.deserialize(blob)))
    return pieces


def _piece_call(artifact) -> Callable:
    """A plain function wrapping the artifact, as compiling makes it: saving a loaded graph again
    finds the artifact behind it; after its first call it skips the artifact's wrappers where
    they have nothing to do (:mod:`fp8conf.compile.fast_call`)."""
    from fp8conf.compile import unit_call

    return unit_call(artifact)


def _bind_pieces(graph, pieces: list[Callable], part: str, path: str) -> None:
    """Put each loaded piece where its stand-in is called, in ``graph`` and every graph module
    inside it, and drop the stand-ins."""
    for inner in [m for m in graph.children() if isinstance(m, torch.fx.GraphModule)]:
        _bind_pieces(inner, pieces, part, path)
    for node in [n for n in graph.graph.nodes if n.op == "call_module"]:
        ref = getattr(graph, node.target, None) if isinstance(node.target, str) else None
        if not isinstance(ref, _PieceRef):
            continue
        if not (type(ref.index) is int and 0 <= ref.index < len(pieces)):
            raise ArtifactError(f"artifact {path!r}: the {part} graph calls compiled piece {ref.index!r}, which the artifact lacks; save it again", path=path)
        node.op, node.target = "call_function", pieces[ref.index]
    for name in [n for n, m in graph.named_children() if isinstance(m, _PieceRef)]:
        delattr(graph, name)
    graph.recompile()


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

        for kind, values in (("primal", primals), ("tangent", tangents)):
            wrong = next((i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)), None)
            if wrong is not None:
                raise ArtifactError(
                    f"PrecompiledSplit.run: {kind} {wrong} must be a tensor, got {type(values[wrong]).__name__}; "
                    "feed it with run_model(model, args, grad_outputs) or JointSignature.feed"
                )
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
    from fp8conf.compile import CompileConfig, compile_split
    from fp8conf.graph.split import StageSplit
    from fp8conf.graph.trace import trace_info

    path = os.fspath(path)
    if not isinstance(split, StageSplit):
        raise FP8ConfigError(f"save_split_artifact: expected a StageSplit from fp8conf.split_stage, got {type(split).__qualname__}")
    if not isinstance(signature, QuantizationSignature):
        raise FP8ConfigError(f"save_split_artifact: signature must be a QuantizationSignature, got {type(signature).__qualname__}")
    signing_key = resolve_signing_key(key, unsigned, path)
    check_write_target(path, error=FileWriteError, what="artifact")  # before the compile a refusal would waste
    info = trace_info(gm)
    check_signature_describes(signature, info.modules if info else None, path)
    inputs, outputs = describe_graph(gm)
    if fns is None:
        # Each unit compiled as the artifact stores it.
        fns = compile_split(split, CompileConfig(mode="regional", saveable_units=True))
    wrong = sorted(name for name, fn in fns.items() if getattr(fn, "mode", None) != "regional")
    if set(fns) != set(split.parts) or wrong:
        raise FP8ConfigError(
            f"save_split_artifact: fns must be compile_split(split, mode='regional')'s result; got parts {sorted(fns)}"
            + (f", {wrong} not regionally compiled" if wrong else "")
        )
    payload, parts, pieces = pack_parts([(name, _graph_of(fns[name]), region_specs(fns[name])) for name in split.parts], path)
    header = ArtifactHeader(
        FORMAT_VERSION, "regional", signature, signature.sha256, len(payload), inputs, outputs,
        fp8conf.__version__, parts=parts, split=_split_layout(split), pieces=pieces,
    )
    header, data = seal(header, payload, signing_key)
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
    from fp8conf.graph.split import StageSplit

    path = os.fspath(path)
    header, payload = verified(path, expected_signature, key, trust_unsigned)
    if header.split is None:
        raise ArtifactError(f"artifact {path!r} holds a {header.mechanism} joint graph, not a GraphPP split; load it with fp8conf.load_artifact", path=path)
    graphs = deserialize_guarded(path, header, lambda: unpack_parts(payload, header, path))
    fns = {name: flat_callable(graph) for name, graph in graphs.items()}
    layout = header.split
    stage = StageSplit(
        fns["forward"], fns["backward_input"], fns["backward_weight"], layout["num_outputs"],
        tuple(layout["saved_for_input"]), tuple(layout["saved_for_weight"]), tuple(layout["input_grads"]),
        tuple(layout["param_grads"]), tuple(None if slot is None else tuple(slot) for slot in layout["output_layout"]),
    )
    joint = signature_of_header(header.inputs, header.outputs)
    return PrecompiledSplit(fns, stage, {p["name"]: p["regions"] for p in header.parts}, joint, header.signature)

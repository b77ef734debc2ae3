"""Precompiled joint graphs saved with the quantization signature they were built for.

An artifact is one file (its layout: :mod:`fp8conf.artifacts.format`) whose header holds the
:class:`~fp8conf.artifacts.signature.QuantizationSignature` it was built for and whose payload is
torch's own serialization of the compiled graph:

* ``standalone_compile`` (the default): the joint graph of :func:`fp8conf.trace_joint`, flattened,
  compiled with ``torch._inductor.standalone_compile`` and saved with
  ``CompiledArtifact.save(format="binary")`` (Inductor's cache artifacts: the generated wrapper
  and kernel sources). Loading it in a fresh process runs the same generated code, so on CPU
  the outputs are bitwise those of the compiled graph that was saved.
* ``graph_pickler``: the traced graph itself, pickled by ``torch.fx._graph_pickler.GraphPickler``
  and compiled when loaded. ``mechanism="auto"`` falls back to it, with a warning, when
  ``standalone_compile`` cannot compile or save a graph.
* ``regional``: the joint graph compiled by :func:`fp8conf.compile_joint` in ``regional`` mode,
  each FP8 region's compiled code with its identity and the eager remainder
  (:mod:`fp8conf.artifacts.regional`, which also saves a GraphPP split's three callables).
  Loading compiles nothing.

:func:`load_artifact` reads nothing of the payload until the file has proven itself, in this
order: it is an fp8conf artifact of this format (:class:`~fp8conf.errors.ArtifactError`), intact
(its digest over header and payload: :class:`~fp8conf.errors.ArtifactIntegrityError`), signed
with the loader's key (its HMAC-SHA256: :class:`~fp8conf.errors.ArtifactAuthenticityError`, see
:mod:`fp8conf.artifacts.keys`), built for the expected signature
(:class:`~fp8conf.errors.FingerprintMismatchError`, naming the change and every differing field)
and, in :func:`load_for_model`, for the model's parameter, buffer and input shapes
(:class:`~fp8conf.errors.StaleArtifactError`). An artifact is executable code: a valid MAC says
a holder of the key wrote it, which is what makes loading it safe.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Callable

from fp8contract.writing import check_write_target
from fp8conf.arguments import require
from fp8conf.artifacts.envelope import (
    check_signature_describes, describe_graph, deserialize_guarded, resolve_signing_key, signature_of_header, verified,
)
from fp8conf.artifacts.format import FORMAT_VERSION, MECHANISMS, ArtifactHeader, read_header, seal, write_atomic
from fp8conf.artifacts.shapes import stale_inputs
from fp8conf.artifacts.signature import QuantizationSignature
from fp8conf.errors import ArtifactError, FileWriteError, FP8ConfigError, StaleArtifactError

__all__ = [
    "PrecompiledJoint",
    "precompile_joint",
    "save_artifact",
    "read_header",
    "load_artifact",
    "precompile_model",
    "load_for_model",
]


def _inputs_from_specs(specs: list[dict]) -> list:
    """Zero tensors of the recorded shapes and dtypes: example inputs for compiling."""
    import torch

    inputs = []
    for spec in specs:
        if "shape" not in spec:
            raise ArtifactError(f"graph input {spec} has no recorded shape; pass example_inputs")
        inputs.append(torch.zeros(spec["shape"], dtype=_dtype(spec["dtype"])))
    return inputs


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in the artifact header")
    return dtype


# --- the compiled joint graph -------------------------------------------------------------------


class PrecompiledJoint:
    """A compiled joint graph: call it on the flat inputs, or :meth:`run` it like
    :func:`fp8conf.run_joint`.

    Attributes:
        inputs / outputs: what each flat input and output is, as the header records it.
        joint_signature: the same as a :class:`~fp8conf.JointSignature`.
        mechanism: ``"standalone_compile"``, ``"graph_pickler"`` or ``"regional"``.
        regions: the identities of the compiled FP8 regions (``regional``; empty otherwise).
        signature: the quantization signature it was loaded with (``None`` when freshly compiled).
    """

    def __init__(self, fn: Callable, inputs: list[dict], outputs: list[dict], mechanism: str, *, artifact=None, graph=None, modules=None,
                 regions=()):
        self._fn = fn
        self.inputs = inputs
        self.outputs = outputs
        self.joint_signature = signature_of_header(inputs, outputs)
        self.mechanism = mechanism
        self.artifact = artifact  # torch's CompiledArtifact, when there is one
        self.graph = graph  # the flat GraphModule, for the graph_pickler mechanism
        self.modules = modules  # QuantizationConfig by FQN of the traced graph, when known
        self.regions = list(regions)
        self.signature: QuantizationSignature | None = None

    def __call__(self, *flat_inputs):
        import torch

        if len(flat_inputs) != len(self.inputs):
            raise ArtifactError(f"the compiled graph takes {len(self.inputs)} inputs, got {len(flat_inputs)}")
        for spec, value in zip(self.inputs, flat_inputs):
            if "shape" in spec and not isinstance(value, torch.Tensor):
                raise ArtifactError(
                    f"graph input {_input_name(spec)} must be a tensor of shape {tuple(spec['shape'])} {spec['dtype']}, "
                    f"got {type(value).__name__}: feed it with run(model, args, grad_outputs) or flat_inputs(...)"
                )
            if "shape" in spec and (list(value.shape) != spec["shape"] or str(value.dtype) != spec["dtype"]):
                raise ArtifactError(
                    f"graph input {_input_name(spec)} was compiled for shape {tuple(spec['shape'])} {spec['dtype']}, "
                    f"got {tuple(value.shape)} {value.dtype}: the artifact is stale for this model"
                )
        with torch.no_grad():
            results = self._fn(*[v.detach() if isinstance(v, torch.Tensor) else v for v in flat_inputs])
        return list(results) if isinstance(results, (list, tuple)) else [results]

    def flat_inputs(self, model, args, grad_outputs) -> list:
        """The flat inputs for ``model``'s current parameters, ``args`` and ``grad_outputs``."""
        from fp8conf.errors import FP8TraceError

        try:
            primals, tangents = self.joint_signature.feed(model, args, grad_outputs)
        except FP8TraceError as exc:
            raise ArtifactError(f"cannot feed the artifact from {type(model).__qualname__}: {exc}; the artifact is stale for this model") from None
        return [*primals, *tangents]

    def run(self, model, args, grad_outputs) -> tuple[tuple, dict]:
        """``(outputs, grads)`` exactly as :func:`fp8conf.run_joint` returns them."""
        return self.joint_signature.results(self(*self.flat_inputs(model, args, grad_outputs)))


def _input_name(spec: dict) -> str:
    return spec.get("target") or f"{spec['kind']}.{spec.get('index')}"


def precompile_config(config, where: str, **keywords):
    """The :class:`~fp8conf.CompileConfig` a precompile compiles with: ``config`` or the keywords
    that make one (:meth:`CompileConfig.of <fp8conf.CompileConfig.of>`; ``mode`` defaults to
    ``"full"`` here), in the form an artifact stores: unpartitioned (an artifact holds one
    compiled joint graph, where a partitioned compile makes two) and, for ``regional``, every
    unit compiled as the artifact stores it. CUDA graphs are a way of calling, not something
    saved: ``cudagraph=True`` is refused."""
    import dataclasses

    from fp8conf.compile import CompileConfig

    if config is None and keywords.get("mode") is None:
        keywords["mode"] = "full"
    config = CompileConfig.of(config, where, **keywords)
    if config.cudagraph:
        raise FP8ConfigError(f"{where}: an artifact cannot hold a CUDA graph; compile with cudagraph=False and "
                             "pass cudagraph=True to compile_joint where the loaded graph is run")
    return dataclasses.replace(config, partition=False, saveable_units=config.mode == "regional")


def precompile_joint(gm, example_inputs=None, config=None, *, mode: str | None = None, strict: bool | None = None) -> PrecompiledJoint:
    """Compile a joint graph of :func:`fp8conf.trace_joint` with :func:`fp8conf.compile_joint`,
    in a form :func:`save_artifact` saves, under ``config`` (a :class:`~fp8conf.CompileConfig`)
    or the keywords that make one (defaults ``mode="full"``, ``strict=True``): ``mode="full"``
    (Inductor's ``standalone_compile``; the result is specialized to ``example_inputs``, the flat
    inputs in placeholder order, tensors like the traced ones when omitted) or ``"regional"``
    (the complete FP8 regions; ``remainder`` and ``workers`` as the config says). The artifact's
    form is fixed (see :func:`precompile_config`): unpartitioned, without CUDA graphs.
    """
    require(gm, "graph module", "precompile_joint", "gm")
    from fp8conf.artifacts.regional import flat_callable, region_specs
    from fp8conf.compile import compile_joint
    from fp8conf.graph.trace import trace_info

    config = precompile_config(config, "precompile_joint", mode=mode, strict=strict)
    inputs, outputs = describe_graph(gm)
    info = trace_info(gm)
    modules = info.modules if info else None
    if config.mode == "full":
        artifact = compile_joint(gm, config, example_inputs=example_inputs).artifact
        return PrecompiledJoint(artifact, inputs, outputs, "standalone_compile", artifact=artifact, modules=modules)
    # One flat graph calling its regions' compiled code.
    compiled = compile_joint(gm, config)
    flat = flat_callable(compiled.artifact)
    return PrecompiledJoint(flat, inputs, outputs, "regional", artifact=compiled.artifact, modules=modules, regions=region_specs(compiled))


def save_artifact(path, gm_or_compiled, signature: QuantizationSignature, example_inputs=None, *, mechanism: str = "auto",
                  key=None, unsigned: bool = False, config=None) -> ArtifactHeader:
    """Save a compiled joint graph with ``signature`` at ``path`` (atomically), signed with ``key``
    (bytes or a key file; by default the environment's, see :mod:`fp8conf.artifacts.keys`), and
    return its header. ``unsigned=True`` writes it without a MAC.

    ``gm_or_compiled`` is a joint graph of :func:`fp8conf.trace_joint` (compiled here) or a
    :class:`PrecompiledJoint` from :func:`precompile_joint`. ``mechanism`` is ``"standalone_compile"``,
    ``"graph_pickler"``, ``"regional"`` or ``"auto"`` (the first, falling back to the second with a
    warning when the graph cannot be compiled or saved). A traced graph is compiled under
    ``config`` (a :class:`~fp8conf.CompileConfig`; see :func:`precompile_joint`), its mode the
    mechanism's: ``regional`` for ``"regional"``, ``full`` otherwise.
    """
    require(path, "path", "save_artifact", "path")
    import torch

    import fp8conf

    path = os.fspath(path)
    signing_key = resolve_signing_key(key, unsigned, path)
    check_write_target(path, error=FileWriteError, what="artifact")  # before the compile a refusal would waste
    if not isinstance(signature, QuantizationSignature):
        raise FP8ConfigError(f"save_artifact: signature must be a QuantizationSignature, got {type(signature).__qualname__}")
    if mechanism not in (*MECHANISMS, "auto"):
        raise FP8ConfigError(f"save_artifact: mechanism must be one of {MECHANISMS + ('auto',)}, got {mechanism!r}")
    note = ""
    if isinstance(gm_or_compiled, PrecompiledJoint):
        compiled = gm_or_compiled
        if mechanism not in ("auto", compiled.mechanism):
            raise ArtifactError(f"save_artifact: this PrecompiledJoint is saved with {compiled.mechanism}, not {mechanism}; pass the traced graph", path=path)
        check_signature_describes(signature, compiled.modules, path)
        payload, parts, pieces = _compiled_payload(compiled, path)
        inputs, outputs, used = compiled.inputs, compiled.outputs, compiled.mechanism
    elif isinstance(gm_or_compiled, torch.fx.GraphModule):
        from fp8conf.graph.trace import trace_info

        info = trace_info(gm_or_compiled)
        check_signature_describes(signature, info.modules if info else None, path)
        inputs, outputs = describe_graph(gm_or_compiled)
        payload, used, parts, pieces, note = _compile_for_saving(gm_or_compiled, mechanism, example_inputs, path, config)
    else:
        raise FP8ConfigError(f"save_artifact: expected a torch.fx.GraphModule from trace_joint or a PrecompiledJoint, got {type(gm_or_compiled).__qualname__}")
    header = ArtifactHeader(
        format_version=FORMAT_VERSION,
        mechanism=used,
        signature=signature,
        fingerprint=signature.sha256,
        payload_size=len(payload),
        inputs=inputs,
        outputs=outputs,
        fp8conf_version=fp8conf.__version__,
        note=note,
        parts=parts,
        pieces=pieces,
    )
    header, data = seal(header, payload, signing_key)
    write_atomic(path, data)
    return header


def _compile_for_saving(gm, mechanism: str, example_inputs, path: str, config=None) -> tuple[bytes, str, list[dict], list[dict], str]:
    """``(payload, mechanism used, parts, pieces, note)`` of the traced graph ``gm`` compiled as asked."""
    import dataclasses

    from fp8conf.compile import CompileConfig

    config = CompileConfig.of(config, "save_artifact")
    if mechanism == "regional":
        payload, parts, pieces = _compiled_payload(precompile_joint(gm, config=dataclasses.replace(config, mode="regional")), path)
        return payload, "regional", parts, pieces, ""
    if mechanism in ("auto", "standalone_compile"):
        try:
            full = precompile_joint(gm, example_inputs, dataclasses.replace(config, mode="full"))
            return _standalone_payload(full.artifact, path), "standalone_compile", [], [], ""
        except Exception as exc:
            if mechanism == "standalone_compile":
                raise ArtifactError(f"cannot compile and save {path!r} with standalone_compile: {type(exc).__name__}: {exc}", path=path) from exc
            note = f"standalone_compile failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); saved the traced graph, compiled on load"
            warnings.warn(f"fp8conf.save_artifact: {note}", stacklevel=3)
            return _pickled_graph_payload(gm, path), "graph_pickler", [], [], note
    return _pickled_graph_payload(gm, path), "graph_pickler", [], [], ""


def _compiled_payload(compiled: PrecompiledJoint, path) -> tuple[bytes, list[dict], list[dict]]:
    """``(payload, parts, pieces)`` of a compiled joint graph."""
    if compiled.mechanism == "regional":
        from fp8conf.artifacts.regional import pack_parts

        return pack_parts([("joint", compiled.artifact, compiled.regions)], path)
    return _standalone_payload(compiled.artifact, path), [], []


def _standalone_payload(artifact, path) -> bytes:
    with tempfile.TemporaryDirectory(prefix="fp8conf-save-") as tmp:
        target = os.path.join(tmp, "compiled.bin")
        try:
            artifact.save(path=target, format="binary")
        except Exception as exc:
            raise ArtifactError(f"torch could not save the compiled graph for {path!r}: {type(exc).__name__}: {exc}", path=str(path)) from exc
        with open(target, "rb") as f:
            return f.read()


def _pickled_graph_payload(gm, path) -> bytes:
    from torch.fx._graph_pickler import GraphPickler, Options

    from fp8conf.graph.trace import flat_graph_module

    flat = flat_graph_module(gm)
    try:
        # Every op may be pickled by name (fp8conf's own ops too); unpickling looks them up.
        return GraphPickler.dumps(flat, Options(ops_filter=None))
    except Exception as exc:
        raise ArtifactError(f"GraphPickler could not serialize the graph for {path!r}: {type(exc).__name__}: {exc}", path=str(path)) from exc



def load_artifact(path, expected_signature: QuantizationSignature, *, key=None, trust_unsigned: bool = False) -> PrecompiledJoint:
    """Load the artifact at ``path`` if, and only if, it is intact, signed with ``key`` (bytes or
    a key file; by default the environment's) and was built for ``expected_signature``.

    Raises :class:`~fp8conf.errors.ArtifactIntegrityError` (altered, truncated),
    :class:`~fp8conf.errors.ArtifactAuthenticityError` (no valid MAC; ``trust_unsigned=True``
    loads it anyway, with a warning: its payload is code that runs), :class:`FingerprintMismatchError`
    (another signature; naming the differing fields) or :class:`ArtifactError` (not an artifact,
    or torch cannot load it). Nothing of the payload is deserialized before these checks pass.
    """
    require(path, "path", "load_artifact", "path")
    require(expected_signature, QuantizationSignature, "load_artifact", "expected_signature",
            "a QuantizationSignature (QuantizationSignature.from_model(model))")
    path = os.fspath(path)
    header, payload = verified(path, expected_signature, key, trust_unsigned)
    return _deserialize(path, header, payload)


def _deserialize(path: str, header: ArtifactHeader, payload: bytes) -> PrecompiledJoint:
    if header.split is not None:
        raise ArtifactError(f"artifact {path!r} holds a GraphPP split; load it with fp8conf.artifacts.regional.load_split_artifact", path=path)
    loaders = {"standalone_compile": _load_standalone, "graph_pickler": _load_pickled_graph, "regional": _load_regional}
    compiled = deserialize_guarded(path, header, lambda: loaders[header.mechanism](payload, header, path))
    compiled.signature = header.signature
    return compiled


def _load_standalone(payload: bytes, header: ArtifactHeader, path: str) -> PrecompiledJoint:
    from torch._inductor.standalone_compile import CompiledArtifact

    with tempfile.TemporaryDirectory(prefix="fp8conf-load-") as tmp:
        target = os.path.join(tmp, "compiled.bin")
        with open(target, "wb") as f:
            f.write(payload)
        artifact = CompiledArtifact.load(path=target, format="binary")
    return PrecompiledJoint(artifact, header.inputs, header.outputs, "standalone_compile", artifact=artifact)


def _load_pickled_graph(payload: bytes, header: ArtifactHeader, path: str) -> PrecompiledJoint:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    flat = GraphPickler.loads(payload, FakeTensorMode(shape_env=ShapeEnv()))
    from fp8conf.compile import compile_joint

    # Compiled on load as precompile_joint compiles a full artifact.
    config = precompile_config(None, "load_artifact", mode="full")
    artifact = compile_joint(flat, config, example_inputs=_inputs_from_specs(header.inputs)).artifact
    return PrecompiledJoint(artifact, header.inputs, header.outputs, "graph_pickler", artifact=artifact, graph=flat)


def _load_regional(payload: bytes, header: ArtifactHeader, path: str) -> PrecompiledJoint:
    from fp8conf.artifacts.regional import flat_callable, unpack_parts

    graph = unpack_parts(payload, header, path)["joint"]
    # The loaded graph is what a regional artifact saves: it can be saved again as it is.
    return PrecompiledJoint(flat_callable(graph), header.inputs, header.outputs, "regional", artifact=graph,
                            regions=header.parts[0]["regions"])


# --- model-level entry points -------------------------------------------------------------------


def precompile_model(path, model, args, config=None, *, strict: bool | None = None, mechanism: str = "auto", key=None,
                     unsigned: bool = False, repeat: str | bool | None = None, per_block: tuple[str, ...] = ()) -> ArtifactHeader:
    """Trace ``model(*args)``'s training step, validate it (strictly when ``config.strict``),
    compile it under ``config`` (a :class:`~fp8conf.CompileConfig`, or the ``strict`` keyword that
    makes one; the mode is ``mechanism``'s, see :func:`save_artifact`) and save it at ``path``
    with the model's quantization signature, signed with ``key`` (see :func:`save_artifact`).
    ``repeat`` and ``per_block`` are :func:`fp8conf.trace_joint`'s: a deep model of equal blocks
    traced at the cost of four."""
    require(path, "path", "precompile_model", "path")
    require(model, "model", "precompile_model", "model")
    from fp8conf.compile import CompileConfig

    config = CompileConfig.of(config, "precompile_model", strict=strict)
    strict = config.strict
    from fp8conf.graph.trace import trace_joint
    from fp8conf.graph.validate import validate_fp8_graph

    path = os.fspath(path)
    signing_key = resolve_signing_key(key, unsigned, path)  # before the compile it would waste
    check_write_target(path, error=FileWriteError, what="artifact")
    signature = QuantizationSignature.from_model(model, strict=strict)
    gm = trace_joint(model, args, repeat=repeat, per_block=per_block)
    validate_fp8_graph(gm, strict=strict)  # a strict artifact is one whose graph passed strict validation
    return save_artifact(path, gm, signature, mechanism=mechanism, key=signing_key, unsigned=signing_key is None, config=config)


def load_for_model(path, model, args=None, *, strict: bool = True, key=None, trust_unsigned: bool = False) -> PrecompiledJoint:
    """Load the artifact at ``path`` for ``model``'s current FP8 configuration (see
    :func:`load_artifact`), refusing it with a :class:`~fp8conf.errors.StaleArtifactError` naming
    what differs when it was compiled for other parameter or buffer shapes or dtypes, or (given
    ``args``, the model's positional inputs) other input shapes, before any of it is deserialized."""
    require(path, "path", "load_for_model", "path")
    require(model, "model", "load_for_model", "model")
    path = os.fspath(path)
    header, payload = verified(path, QuantizationSignature.from_model(model, strict=strict), key, trust_unsigned)
    stale = stale_inputs(header, model, args)  # from the header alone: nothing is deserialized yet
    if stale:
        lines = "\n".join(f"  {name}: {old} (artifact) -> {new} (current)" for name, old, new in stale)
        raise StaleArtifactError(
            f"artifact {path!r} was compiled for other shapes than {type(model).__qualname__}'s and is not used "
            f"({len(stale)} input{'s' if len(stale) != 1 else ''} differ):\n{lines}\n"
            "Recompile and save it again (`fp8conf precompile save`) for the current model.",
            path=path, differences=tuple(stale),
        )
    return _deserialize(path, header, payload)


def describe(header: ArtifactHeader) -> dict[str, Any]:
    """The header as plain data, for the CLI."""
    return header.to_dict()

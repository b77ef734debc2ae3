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

:func:`load_artifact` checks, in this order and before torch deserializes anything, that the file
is an fp8conf artifact of a known format (:class:`~fp8conf.errors.ArtifactError` otherwise), that
it is complete and uncorrupted (payload size and sha256; ``ArtifactError``), and that its
signature equals the expected one; a different signature raises
:class:`~fp8conf.errors.FingerprintMismatchError` naming every differing field, and the payload is
never touched. Payloads are pickles: load only artifacts you trust.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from typing import Any, Callable

from fp8conf.artifacts.format import FORMAT_VERSION, MECHANISMS, ArtifactHeader, encode, read_artifact, read_header, write_atomic
from fp8conf.artifacts.signature import QuantizationSignature, format_differences
from fp8conf.errors import ArtifactError, FingerprintMismatchError, FP8ConfigError

__all__ = [
    "PrecompiledJoint",
    "precompile_joint",
    "save_artifact",
    "read_header",
    "load_artifact",
    "precompile_model",
    "load_for_model",
]


# --- describing the flat graph ------------------------------------------------------------------


def _tensor_spec(val) -> dict:
    if val is None or not hasattr(val, "shape"):
        return {}
    return {"shape": [int(s) for s in val.shape], "dtype": str(val.dtype)}


_INPUT_KINDS = {"param": "param", "buffer": "buffer", "input": "input", "tangent": "tangent", "other": "flat"}
_OUTPUT_KINDS = {"output": "output", "param_grad": "grad", "input_grad": "grad", "other": "flat"}


def _describe(gm) -> tuple[list[dict], list[dict]]:
    """The header's description of every flat input and output: the joint signature, with the
    traced shape and dtype of each input."""
    signature = _joint_signature(gm)
    inputs = []
    for spec, node in zip(signature.inputs, gm.graph.find_nodes(op="placeholder")):
        entry = {"kind": _INPUT_KINDS[spec.kind]}
        entry.update({"target": spec.target} if spec.target is not None else {"index": spec.index})
        inputs.append({**entry, **_tensor_spec(node.meta.get("val"))})
    outputs = []
    for i, spec in enumerate(signature.outputs):
        if spec is None:
            outputs.append({"kind": "none", "index": i})
        elif spec.kind in ("param_grad", "input_grad"):
            outputs.append({"kind": "grad", "target": spec.target})
        else:
            outputs.append({"kind": _OUTPUT_KINDS[spec.kind], "index": spec.index})
    return inputs, outputs


def _joint_signature(gm):
    from fp8conf.graph.trace import joint_signature

    signature = joint_signature(gm)
    if signature is None:
        raise ArtifactError(
            "cannot describe the graph's inputs and outputs: it carries no joint signature (gm.meta); "
            "trace it with fp8conf.trace_joint and keep gm.meta in rewrites"
        )
    return signature


def _signature_of_header(inputs: list[dict], outputs: list[dict]):
    """The :class:`~fp8conf.JointSignature` an artifact header describes."""
    from fp8conf.graph.trace import JointInput, JointOutput, JointSignature

    kinds = {v: k for k, v in _INPUT_KINDS.items()}
    joint_inputs = tuple(JointInput(kinds.get(e["kind"], "other"), e.get("target"), e.get("index")) for e in inputs)
    joint_outputs = []
    for i, e in enumerate(outputs):
        if e["kind"] == "none":
            joint_outputs.append(None)
        elif e["kind"] == "grad":
            target = e["target"]
            is_input = target.startswith("input.")
            joint_outputs.append(JointOutput("input_grad" if is_input else "param_grad", target, int(target[6:]) if is_input else None))
        elif e["kind"] == "output":
            joint_outputs.append(JointOutput("output", index=e["index"]))
        else:
            joint_outputs.append(JointOutput("other", index=i))
    return JointSignature(joint_inputs, tuple(joint_outputs))


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
        mechanism: ``"standalone_compile"`` or ``"graph_pickler"``.
        signature: the quantization signature it was loaded with (``None`` when freshly compiled).
    """

    def __init__(self, fn: Callable, inputs: list[dict], outputs: list[dict], mechanism: str, *, artifact=None, graph=None, modules=None):
        self._fn = fn
        self.inputs = inputs
        self.outputs = outputs
        self.joint_signature = _signature_of_header(inputs, outputs)
        self.mechanism = mechanism
        self.artifact = artifact  # torch's CompiledArtifact, when there is one
        self.graph = graph  # the flat GraphModule, for the graph_pickler mechanism
        self.modules = modules  # QuantizationConfig by FQN of the traced graph, when known
        self.signature: QuantizationSignature | None = None

    def __call__(self, *flat_inputs):
        import torch

        if len(flat_inputs) != len(self.inputs):
            raise ArtifactError(f"the compiled graph takes {len(self.inputs)} inputs, got {len(flat_inputs)}")
        for spec, value in zip(self.inputs, flat_inputs):
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


def _compile_full(gm, example_inputs=None):
    """``gm`` compiled whole by :func:`fp8conf.compile_joint`: torch's ``CompiledArtifact``."""
    from fp8conf.graph.compile import compile_joint

    # Unpartitioned: an artifact holds one compiled joint graph (a partitioned compile makes two).
    return compile_joint(gm, mode="full", example_inputs=example_inputs, partition=False).artifact


def precompile_joint(gm, example_inputs=None) -> PrecompiledJoint:
    """Compile a joint graph of :func:`fp8conf.trace_joint` whole (:func:`fp8conf.compile_joint`,
    ``mode="full"``: Inductor's ``standalone_compile``), in a form :func:`save_artifact` saves.

    ``example_inputs`` are the flat inputs in placeholder order (tensors like the traced ones when
    omitted); the result is specialized to their shapes.
    """
    from fp8conf.graph.trace import trace_info

    inputs, outputs = _describe(gm)
    artifact = _compile_full(gm, example_inputs)
    info = trace_info(gm)
    return PrecompiledJoint(artifact, inputs, outputs, "standalone_compile", artifact=artifact, modules=info.modules if info else None)


def _check_signature_describes(signature: QuantizationSignature, modules, path) -> None:
    """Refuse to save a graph under a signature that does not describe its quantized modules."""
    if modules is None:
        return
    described = {m.fqn: m for m in signature.modules}
    wrong = []
    for fqn, config in modules.items():
        m = described.get(fqn)
        if m is None:
            wrong.append(f"{fqn!r} is quantized in the graph but not in the signature")
        elif (m.kind, m.recipe, m.emulate) != (config.kind, config.recipe, config.emulate):
            wrong.append(
                f"{fqn!r} is {config.kind}/{config.recipe}/emulate={config.emulate} in the graph but "
                f"{m.kind}/{m.recipe}/emulate={m.emulate} in the signature"
            )
    if wrong:
        raise ArtifactError(
            f"cannot save artifact {path!r}: the signature does not describe the traced graph: " + "; ".join(wrong)
            + ". Build the signature from the model that was traced.",
            path=str(path),
        )


def save_artifact(path, gm_or_compiled, signature: QuantizationSignature, example_inputs=None, *, mechanism: str = "auto") -> ArtifactHeader:
    """Save a compiled joint graph with ``signature`` at ``path`` (atomically) and return its header.

    ``gm_or_compiled`` is a joint graph of :func:`fp8conf.trace_joint` (compiled here) or a
    :class:`PrecompiledJoint` from :func:`precompile_joint`. ``mechanism`` is ``"standalone_compile"``,
    ``"graph_pickler"`` or ``"auto"`` (the first, falling back to the second with a warning when
    the graph cannot be compiled or saved).
    """
    import torch

    import fp8conf

    path = os.fspath(path)
    if not isinstance(signature, QuantizationSignature):
        raise FP8ConfigError(f"save_artifact: signature must be a QuantizationSignature, got {type(signature).__qualname__}")
    if mechanism not in (*MECHANISMS, "auto"):
        raise FP8ConfigError(f"save_artifact: mechanism must be one of {MECHANISMS + ('auto',)}, got {mechanism!r}")
    note = ""
    if isinstance(gm_or_compiled, PrecompiledJoint):
        compiled = gm_or_compiled
        if mechanism == "graph_pickler":
            raise ArtifactError("save_artifact: a PrecompiledJoint is saved with standalone_compile; pass the traced graph for graph_pickler", path=path)
        _check_signature_describes(signature, compiled.modules, path)
        payload = _standalone_payload(compiled.artifact, path)
        inputs, outputs, used = compiled.inputs, compiled.outputs, "standalone_compile"
    elif isinstance(gm_or_compiled, torch.fx.GraphModule):
        from fp8conf.graph.trace import trace_info

        gm = gm_or_compiled
        info = trace_info(gm)
        _check_signature_describes(signature, info.modules if info else None, path)
        inputs, outputs = _describe(gm)
        payload, used = None, mechanism
        if mechanism in ("auto", "standalone_compile"):
            try:
                payload = _standalone_payload(precompile_joint(gm, example_inputs).artifact, path)
                used = "standalone_compile"
            except Exception as exc:
                if mechanism == "standalone_compile":
                    raise ArtifactError(f"cannot compile and save {path!r} with standalone_compile: {type(exc).__name__}: {exc}", path=path) from exc
                note = f"standalone_compile failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); saved the traced graph, compiled on load"
                warnings.warn(f"fp8conf.save_artifact: {note}", stacklevel=2)
        if payload is None:
            payload, used = _pickled_graph_payload(gm, path), "graph_pickler"
    else:
        raise FP8ConfigError(f"save_artifact: expected a torch.fx.GraphModule from trace_joint or a PrecompiledJoint, got {type(gm_or_compiled).__qualname__}")
    header = ArtifactHeader(
        format_version=FORMAT_VERSION,
        mechanism=used,
        signature=signature,
        fingerprint=signature.sha256,
        payload_size=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        inputs=inputs,
        outputs=outputs,
        fp8conf_version=fp8conf.__version__,
        note=note,
    )
    write_atomic(path, encode(header, payload))
    return header


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



def _mismatch(path, header: ArtifactHeader, expected: QuantizationSignature) -> FingerprintMismatchError:
    differences = header.signature.diff(expected)
    message = (
        f"artifact {path!r} was built for another FP8 configuration and is not used: fingerprint "
        f"{header.fingerprint[:16]} (artifact) != {expected.sha256[:16]} (current). Differing fields "
        f"({len(differences)}): " + ", ".join(d[0] for d in differences) + "\n"
        + format_differences(differences, left="artifact", right="current", limit=40)
        + "\nRecompile and save it again (`fp8conf precompile save`) for the current configuration."
    )
    return FingerprintMismatchError(
        message, path=path, differences=differences, artifact_fingerprint=header.fingerprint, current_fingerprint=expected.sha256,
    )


def load_artifact(path, expected_signature: QuantizationSignature) -> PrecompiledJoint:
    """Load the artifact at ``path`` if, and only if, it was built for ``expected_signature``.

    Raises :class:`ArtifactError` for a file that is not a complete, intact artifact or that torch
    cannot load, and :class:`FingerprintMismatchError` (naming the differing fields) for an
    artifact of another signature; in both cases nothing of the payload is deserialized.
    """
    path = os.fspath(path)
    if not isinstance(expected_signature, QuantizationSignature):
        raise FP8ConfigError(f"load_artifact: expected_signature must be a QuantizationSignature, got {type(expected_signature).__qualname__}")
    header, payload = read_artifact(path)
    if header.signature != expected_signature or header.fingerprint != expected_signature.sha256:
        raise _mismatch(path, header, expected_signature)
    _register_fp8conf_ops()
    try:
        if header.mechanism == "standalone_compile":
            compiled = _load_standalone(payload, header)
        else:
            compiled = _load_pickled_graph(payload, header)
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"torch could not load artifact {path!r} ({header.mechanism}): {type(exc).__name__}: {exc}", path=path) from exc
    compiled.signature = header.signature
    return compiled


def _register_fp8conf_ops() -> None:
    try:  # graphs may call fp8conf's custom ops, which must be registered before loading
        import fp8conf.quantized.ops  # noqa: F401
    except Exception:
        pass


def _load_standalone(payload: bytes, header: ArtifactHeader) -> PrecompiledJoint:
    from torch._inductor.standalone_compile import CompiledArtifact

    with tempfile.TemporaryDirectory(prefix="fp8conf-load-") as tmp:
        target = os.path.join(tmp, "compiled.bin")
        with open(target, "wb") as f:
            f.write(payload)
        artifact = CompiledArtifact.load(path=target, format="binary")
    return PrecompiledJoint(artifact, header.inputs, header.outputs, "standalone_compile", artifact=artifact)


def _load_pickled_graph(payload: bytes, header: ArtifactHeader) -> PrecompiledJoint:
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    flat = GraphPickler.loads(payload, FakeTensorMode(shape_env=ShapeEnv()))
    artifact = _compile_full(flat, _inputs_from_specs(header.inputs))
    return PrecompiledJoint(artifact, header.inputs, header.outputs, "graph_pickler", artifact=artifact, graph=flat)


# --- model-level entry points -------------------------------------------------------------------


def precompile_model(path, model, args, *, strict: bool = True, mechanism: str = "auto") -> ArtifactHeader:
    """Trace ``model(*args)``'s training step, validate it (strictly when ``strict``), compile it
    and save it at ``path`` with the model's quantization signature."""
    from fp8conf.graph.trace import trace_joint
    from fp8conf.graph.validate import validate_fp8_graph

    signature = QuantizationSignature.from_model(model, strict=strict)
    gm = trace_joint(model, args)
    validate_fp8_graph(gm, strict=strict)  # a strict artifact is one whose graph passed strict validation
    return save_artifact(path, gm, signature, mechanism=mechanism)


def load_for_model(path, model, *, strict: bool = True) -> PrecompiledJoint:
    """Load the artifact at ``path`` for ``model``'s current FP8 configuration (see :func:`load_artifact`)."""
    return load_artifact(path, QuantizationSignature.from_model(model, strict=strict))


def describe(header: ArtifactHeader) -> dict[str, Any]:
    """The header as plain data, for the CLI."""
    return header.to_dict()

"""Precompiled joint graphs saved with the quantization signature they were built for.

An artifact is one file::

    b"FP8CONF-ARTIFACT\\n"  | 8-byte big-endian header length | header (canonical JSON) | payload

The header holds the :class:`~fp8conf.fingerprint.QuantizationSignature` and its sha256, the
mechanism that wrote the payload, the payload's size and sha256, and what every graph input and
output is (parameter FQN, user input, tangent; shape and dtype). The payload is torch's own
serialization of the compiled graph:

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

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Callable

from fp8conf.errors import ArtifactError, FingerprintMismatchError
from fp8conf.fingerprint import QuantizationSignature, format_differences

__all__ = [
    "ARTIFACT_MAGIC",
    "FORMAT_VERSION",
    "MECHANISMS",
    "ArtifactHeader",
    "PrecompiledJoint",
    "precompile_joint",
    "save_artifact",
    "read_header",
    "load_artifact",
    "precompile_model",
    "load_for_model",
]

ARTIFACT_MAGIC = b"FP8CONF-ARTIFACT\n"
FORMAT_VERSION = 1
MECHANISMS = ("standalone_compile", "graph_pickler")
_LENGTH_BYTES = 8
_MAX_HEADER = 64 << 20


# --- describing the flat graph ------------------------------------------------------------------


def _flat_graph_module(gm):
    """A copy of ``gm`` whose forward takes the placeholders positionally and returns a flat list."""
    import copy

    import torch.fx
    from torch.fx.graph import CodeGen

    graph = copy.deepcopy(gm.graph)
    graph._codegen = CodeGen()
    flat = torch.fx.GraphModule(gm, graph, class_name="FP8ConfFlatJoint")
    flat.recompile()
    return flat


def _tensor_spec(val) -> dict:
    if val is None or not hasattr(val, "shape"):
        return {}
    return {"shape": [int(s) for s in val.shape], "dtype": str(val.dtype)}


def _describe_inputs(gm) -> list[dict]:
    from torch._functorch._aot_autograd import descriptors as d

    described = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        desc = node.meta.get("desc")
        if isinstance(desc, d.ParamAOTInput):
            entry = {"kind": "param", "target": desc.target}
        elif isinstance(desc, d.BufferAOTInput):
            entry = {"kind": "buffer", "target": desc.target}
        elif isinstance(desc, d.PlainAOTInput):
            entry = {"kind": "input", "index": desc.idx}
        elif isinstance(desc, d.TangentAOTInput) and isinstance(desc.output, d.PlainAOTOutput):
            entry = {"kind": "tangent", "index": desc.output.idx}
        else:
            entry = {"kind": "flat", "index": i}
        described.append({**entry, **_tensor_spec(node.meta.get("val"))})
    return described


def _describe_outputs(gm) -> list[dict]:
    from torch._functorch._aot_autograd import descriptors as d

    output = gm.graph.find_nodes(op="output")[0]
    descs = output.meta.get("desc")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    if not descs or len(descs) != len(values):
        return [{"kind": "flat", "index": i} for i in range(len(values))]
    described = []
    for i, desc in enumerate(descs):
        if isinstance(desc, d.PlainAOTOutput):
            described.append({"kind": "output", "index": desc.idx})
        elif isinstance(desc, d.GradAOTOutput):
            grad_of = desc.grad_of
            target = f"input.{grad_of.idx}" if isinstance(grad_of, d.PlainAOTInput) else getattr(grad_of, "target", repr(grad_of))
            described.append({"kind": "grad", "target": target})
        else:
            described.append({"kind": "flat", "index": i})
    return described


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
        inputs / outputs: what each flat input and output is (see the module docstring).
        mechanism: ``"standalone_compile"`` or ``"graph_pickler"``.
        signature: the quantization signature it was loaded with (``None`` when freshly compiled).
    """

    def __init__(self, fn: Callable, inputs: list[dict], outputs: list[dict], mechanism: str, *, artifact=None, graph=None, modules=None):
        self._fn = fn
        self.inputs = inputs
        self.outputs = outputs
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
        import torch

        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        grad_outputs = (grad_outputs,) if isinstance(grad_outputs, torch.Tensor) else tuple(grad_outputs)
        state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        values = []
        for spec in self.inputs:
            kind = spec["kind"]
            if kind in ("param", "buffer"):
                if spec["target"] not in state:
                    raise ArtifactError(f"the artifact needs {kind} {spec['target']!r}, which the model lacks: the artifact is stale for this model")
                values.append(state[spec["target"]])
            elif kind == "input":
                values.append(args[spec["index"]])
            elif kind == "tangent":
                values.append(grad_outputs[spec["index"]])
            else:
                raise ArtifactError(f"cannot feed graph input {spec} from a model; call the compiled graph with flat inputs")
        return values

    def run(self, model, args, grad_outputs) -> tuple[tuple, dict]:
        """``(outputs, grads)`` exactly as :func:`fp8conf.run_joint` returns them."""
        results = self(*self.flat_inputs(model, args, grad_outputs))
        outputs, grads = {}, {}
        for spec, value in zip(self.outputs, results):
            if spec["kind"] == "output":
                outputs[spec["index"]] = value
            elif spec["kind"] == "grad" and value is not None:
                grads[spec["target"]] = value
        return tuple(outputs[i] for i in sorted(outputs)), grads


def _input_name(spec: dict) -> str:
    return spec.get("target") or f"{spec['kind']}.{spec.get('index')}"


def _standalone_compile(flat, example_inputs):
    import torch

    return torch._inductor.standalone_compile(flat, list(example_inputs), dynamic_shapes="from_example_inputs")


def _example_inputs(flat, inputs: list[dict], example_inputs) -> list:
    import torch

    if example_inputs is not None:
        example_inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in example_inputs]
        if len(example_inputs) != len(inputs):
            raise ArtifactError(f"the joint graph takes {len(inputs)} inputs, {len(example_inputs)} example inputs given")
        return example_inputs
    return _inputs_from_specs(inputs)


def precompile_joint(gm, example_inputs=None) -> PrecompiledJoint:
    """Compile a joint graph of :func:`fp8conf.trace_joint` with Inductor's ``standalone_compile``.

    ``example_inputs`` are the flat inputs in placeholder order (zeros of the traced shapes when
    omitted); the result is specialized to their shapes.
    """
    from fp8conf.trace import trace_info

    flat = _flat_graph_module(gm)
    inputs, outputs = _describe_inputs(gm), _describe_outputs(gm)
    artifact = _standalone_compile(flat, _example_inputs(flat, inputs, example_inputs))
    info = trace_info(gm)
    return PrecompiledJoint(artifact, inputs, outputs, "standalone_compile", artifact=artifact, modules=info.modules if info else None)


# --- the file format ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArtifactHeader:
    """What an artifact says about itself, read without touching its payload."""

    format_version: int
    mechanism: str
    signature: QuantizationSignature
    fingerprint: str
    payload_size: int
    payload_sha256: str
    inputs: list
    outputs: list
    fp8conf_version: str
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "mechanism": self.mechanism,
            "signature": self.signature.to_dict(),
            "fingerprint": self.fingerprint,
            "payload_size": self.payload_size,
            "payload_sha256": self.payload_sha256,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "fp8conf_version": self.fp8conf_version,
            "note": self.note,
        }


def _encode(header: ArtifactHeader, payload: bytes) -> bytes:
    text = json.dumps(header.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return ARTIFACT_MAGIC + len(text).to_bytes(_LENGTH_BYTES, "big") + text + payload


def _write_atomic(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".fp8conf-artifact-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a reader never sees a half-written artifact
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        raise TypeError(f"save_artifact: signature must be a QuantizationSignature, got {type(signature).__qualname__}")
    if mechanism not in (*MECHANISMS, "auto"):
        raise ValueError(f"save_artifact: mechanism must be one of {MECHANISMS + ('auto',)}, got {mechanism!r}")
    note = ""
    if isinstance(gm_or_compiled, PrecompiledJoint):
        compiled = gm_or_compiled
        if mechanism == "graph_pickler":
            raise ArtifactError("save_artifact: a PrecompiledJoint is saved with standalone_compile; pass the traced graph for graph_pickler", path=path)
        _check_signature_describes(signature, compiled.modules, path)
        payload = _standalone_payload(compiled.artifact, path)
        inputs, outputs, used = compiled.inputs, compiled.outputs, "standalone_compile"
    elif isinstance(gm_or_compiled, torch.fx.GraphModule):
        from fp8conf.trace import trace_info

        gm = gm_or_compiled
        info = trace_info(gm)
        _check_signature_describes(signature, info.modules if info else None, path)
        inputs, outputs = _describe_inputs(gm), _describe_outputs(gm)
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
        raise TypeError(f"save_artifact: expected a torch.fx.GraphModule from trace_joint or a PrecompiledJoint, got {type(gm_or_compiled).__qualname__}")
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
    _write_atomic(path, _encode(header, payload))
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

    flat = _flat_graph_module(gm)
    try:
        # Every op may be pickled by name (fp8conf's own ops too); unpickling looks them up.
        return GraphPickler.dumps(flat, Options(ops_filter=None))
    except Exception as exc:
        raise ArtifactError(f"GraphPickler could not serialize the graph for {path!r}: {type(exc).__name__}: {exc}", path=str(path)) from exc


def _read(path) -> tuple[ArtifactHeader, bytes]:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ArtifactError(f"cannot read artifact {path!r}: {exc}", path=path) from exc
    if not data.startswith(ARTIFACT_MAGIC):
        raise ArtifactError(f"{path!r} is not an fp8conf artifact (bad magic bytes); save one with `fp8conf precompile save`", path=path)
    start = len(ARTIFACT_MAGIC) + _LENGTH_BYTES
    if len(data) < start:
        raise ArtifactError(f"artifact {path!r} is truncated: {len(data)} bytes, its header length is missing", path=path)
    length = int.from_bytes(data[len(ARTIFACT_MAGIC):start], "big")
    if length > _MAX_HEADER:
        raise ArtifactError(f"artifact {path!r} is corrupt: header length {length} is implausible", path=path)
    if len(data) < start + length:
        raise ArtifactError(f"artifact {path!r} is truncated: header of {length} bytes, only {len(data) - start} present", path=path)
    try:
        raw = json.loads(data[start:start + length].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArtifactError(f"artifact {path!r} is corrupt: its header is not JSON ({exc})", path=path) from None
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        version = raw.get("format_version") if isinstance(raw, dict) else None
        raise ArtifactError(f"artifact {path!r} has format version {version!r}; this fp8conf reads version {FORMAT_VERSION}. Re-save it.", path=path)
    try:
        signature = QuantizationSignature.from_dict(raw["signature"])
        header = ArtifactHeader(
            format_version=raw["format_version"],
            mechanism=raw["mechanism"],
            signature=signature,
            fingerprint=raw["fingerprint"],
            payload_size=int(raw["payload_size"]),
            payload_sha256=raw["payload_sha256"],
            inputs=raw["inputs"],
            outputs=raw["outputs"],
            fp8conf_version=raw.get("fp8conf_version", "?"),
            note=raw.get("note", ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"artifact {path!r} is corrupt: malformed header ({exc})", path=path) from None
    if header.mechanism not in MECHANISMS:
        raise ArtifactError(f"artifact {path!r} was written by unknown mechanism {header.mechanism!r}", path=path)
    if signature.sha256 != header.fingerprint:
        raise ArtifactError(f"artifact {path!r} is corrupt: its signature does not hash to its recorded fingerprint", path=path)
    payload = data[start + length:]
    if len(payload) != header.payload_size:
        state = "truncated" if len(payload) < header.payload_size else "corrupt (trailing bytes)"
        raise ArtifactError(f"artifact {path!r} is {state}: payload of {len(payload)} bytes, expected {header.payload_size}", path=path)
    if hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        raise ArtifactError(f"artifact {path!r} is corrupt: payload sha256 does not match the header", path=path)
    return header, payload


def read_header(path) -> ArtifactHeader:
    """The header of the artifact at ``path``, after checking the file is complete and intact."""
    return _read(path)[0]


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
        raise TypeError(f"load_artifact: expected_signature must be a QuantizationSignature, got {type(expected_signature).__qualname__}")
    header, payload = _read(path)
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
        import fp8conf.ops  # noqa: F401
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
    artifact = _standalone_compile(flat, _inputs_from_specs(header.inputs))
    return PrecompiledJoint(artifact, header.inputs, header.outputs, "graph_pickler", artifact=artifact, graph=flat)


# --- model-level entry points -------------------------------------------------------------------


def precompile_model(path, model, args, *, strict: bool = True, mechanism: str = "auto") -> ArtifactHeader:
    """Trace ``model(*args)``'s training step, validate it (strictly when ``strict``), compile it
    and save it at ``path`` with the model's quantization signature."""
    import torch

    from fp8conf.trace import trace_joint
    from fp8conf.validate import validate_fp8_graph

    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    signature = QuantizationSignature.from_model(model, strict=strict)
    gm = trace_joint(model, args)
    validate_fp8_graph(gm, strict=strict)  # a strict artifact is one whose graph passed strict validation
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    example = []
    for spec, zero in zip(_describe_inputs(gm), _inputs_from_specs(_describe_inputs(gm))):
        if spec["kind"] in ("param", "buffer"):
            example.append(state[spec["target"]])
        elif spec["kind"] == "input":
            example.append(args[spec["index"]])
        else:
            example.append(zero)
    return save_artifact(path, gm, signature, example, mechanism=mechanism)


def load_for_model(path, model, *, strict: bool = True) -> PrecompiledJoint:
    """Load the artifact at ``path`` for ``model``'s current FP8 configuration (see :func:`load_artifact`)."""
    return load_artifact(path, QuantizationSignature.from_model(model, strict=strict))


def describe(header: ArtifactHeader) -> dict[str, Any]:
    """The header as plain data, for the CLI."""
    return header.to_dict()

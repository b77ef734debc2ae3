"""What every artifact carries around its payload, and the checks made before any of it is read.

An artifact's header describes the flat graph's inputs and outputs (its joint signature, with
the traced shape and dtype of each input); it is sealed with the key the saver resolves. A
loader proves the file intact and authentic (:func:`fp8conf.artifacts.format.read_artifact`),
then built for the expected quantization signature (:func:`verified`), before
:func:`deserialize_guarded` lets torch read the payload. The joint graph's artifacts
(:mod:`fp8conf.artifacts.store`) and a GraphPP split's (:mod:`fp8conf.artifacts.regional`) share
all of it.
"""

from __future__ import annotations

from typing import Callable

from fp8conf.artifacts.format import ArtifactHeader, read_artifact
from fp8conf.artifacts.keys import ENV_KEY_FILE, resolve_key
from fp8conf.artifacts.signature import QuantizationSignature, describe_changes, format_differences
from fp8conf.errors import ArtifactError, FingerprintMismatchError, FP8ConfigError

__all__ = [
    "describe_graph", "signature_of_header", "check_signature_describes", "resolve_signing_key", "verified", "deserialize_guarded",
]


# --- describing the flat graph ------------------------------------------------------------------


def _tensor_spec(val) -> dict:
    if val is None or not hasattr(val, "shape"):
        return {}
    return {"shape": [int(s) for s in val.shape], "dtype": str(val.dtype)}


_INPUT_KINDS = {"param": "param", "buffer": "buffer", "input": "input", "tangent": "tangent", "other": "flat"}
_OUTPUT_KINDS = {"output": "output", "param_grad": "grad", "input_grad": "grad", "other": "flat"}


def describe_graph(gm) -> tuple[list[dict], list[dict]]:
    """The header's description of every flat input and output: the joint signature, with the
    traced shape and dtype of each input."""
    signature = _joint_signature(gm)
    sharded = next((spec.target for spec in signature.inputs if spec.attrs), None)
    if sharded is not None:
        raise ArtifactError(
            f"cannot save an artifact of a sharded step yet: parameter '{sharded}' is a tensor subclass (a DTensor shard) "
            "whose inner values the graph takes, which the artifact header does not describe; precompile the unsharded step"
        )
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


def signature_of_header(inputs: list[dict], outputs: list[dict]):
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


def check_signature_describes(signature: QuantizationSignature, modules, path) -> None:
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


def resolve_signing_key(key, unsigned: bool, path: str) -> bytes | None:
    if unsigned:
        if key is not None:
            raise FP8ConfigError("save_artifact: pass a key or unsigned=True, not both")
        return None
    found = resolve_key(key)
    if found is None:
        raise FP8ConfigError(
            f"cannot save artifact {path!r}: no key to sign it with. Make one with `fp8conf precompile keygen --out FILE` "
            f"and set ${ENV_KEY_FILE}=FILE (or pass key=); unsigned=True writes an artifact that loads only with trust_unsigned=True"
        )
    return found


def _mismatch(path, header: ArtifactHeader, expected: QuantizationSignature) -> FingerprintMismatchError:
    differences = header.signature.diff(expected)
    message = (
        f"artifact {path!r} was built for another FP8 configuration and is not used:\n"
        + "\n".join(f"  {line}" for line in describe_changes(differences))
        + f"\nFields that differ ({len(differences)}):\n"
        + format_differences(differences, left="artifact", right="current", limit=40)
        + f"\nFingerprint {header.fingerprint[:16]} (artifact) != {expected.sha256[:16]} (current). "
        "Recompile and save it again (`fp8conf precompile save`) for the current configuration."
    )
    return FingerprintMismatchError(
        message, path=path, differences=differences, artifact_fingerprint=header.fingerprint, current_fingerprint=expected.sha256,
    )


def verified(path, expected_signature, key, trust_unsigned) -> tuple[ArtifactHeader, bytes]:
    """The header and payload of an artifact that is intact, authentic and built for ``expected_signature``."""
    if not isinstance(expected_signature, QuantizationSignature):
        raise FP8ConfigError(f"load_artifact: expected_signature must be a QuantizationSignature, got {type(expected_signature).__qualname__}")
    header, payload = read_artifact(path, key=key, trust_unsigned=trust_unsigned)
    if header.signature != expected_signature or header.fingerprint != expected_signature.sha256:
        raise _mismatch(path, header, expected_signature)
    return header, payload


def deserialize_guarded(path: str, header: ArtifactHeader, load: Callable):
    """``load()``, torch's failures as an :class:`ArtifactError` naming the artifact."""
    _register_fp8conf_ops()
    try:
        return load()
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"torch could not load artifact {path!r} ({header.mechanism}): {type(exc).__name__}: {exc}", path=path) from exc


def _register_fp8conf_ops() -> None:
    try:  # graphs may call fp8conf's custom ops, which must be registered before loading
        import fp8conf.quantized.ops  # noqa: F401
    except Exception as exc:
        from fp8conf.log import warn_once

        warn_once("ops", "artifact", f"fp8conf's custom ops could not be registered ({type(exc).__name__}: {exc}); "
                  "an artifact whose graph calls them will fail to load")

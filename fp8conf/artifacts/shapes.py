"""Whether an artifact was compiled for the shapes of the model loading it.

A quantization fingerprint deliberately ignores shapes (the trainer's own fingerprint covers the
model's structure), so an artifact of a model with other widths has the same fingerprint and
would only fail, or worse, when run. :func:`stale_inputs` compares what an artifact's header
records for every parameter, buffer and positional input with the model and inputs at hand,
from the header alone, before anything of the payload is deserialized.
"""

from __future__ import annotations

__all__ = ["stale_inputs"]


def _spec_text(spec: dict | None) -> str | None:
    if spec is None:
        return None
    return f"{tuple(spec['shape'])} {spec['dtype'].removeprefix('torch.')}" if "shape" in spec else "a non-tensor"


def _tensor_text(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return f"a {type(value).__qualname__}"


def stale_inputs(header, model, args=None) -> list[tuple[str, str | None, str | None]]:
    """``(name, artifact's shape and dtype, model's)`` for every parameter, buffer and (given
    ``args``) positional input whose shape or dtype differs from the header's, ``None`` for a
    side that lacks it."""
    from fp8conf.graph.trace import as_args

    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    args = as_args(args) if args is not None else None
    stale, recorded = [], set()
    for spec in header.inputs:
        if spec["kind"] in ("param", "buffer"):
            name, value, present = spec["target"], state.get(spec["target"]), spec["target"] in state
            recorded.add(name)
        elif spec["kind"] == "input" and args is not None:
            name, present = f"input {spec['index']}", spec["index"] < len(args)
            value = args[spec["index"]] if present else None
        else:
            continue
        if not present:
            stale.append((name, _spec_text(spec), None))
        elif "shape" in spec and _spec_text(spec) != _tensor_text(value):
            stale.append((name, _spec_text(spec), _tensor_text(value)))
    unique = dict(model.named_parameters()) | dict(model.named_buffers())
    stale += [(name, None, _tensor_text(value)) for name, value in unique.items() if name not in recorded]
    if args is not None:
        declared = {spec["index"] for spec in header.inputs if spec["kind"] == "input"}
        stale += [(f"input {i}", None, _tensor_text(a)) for i, a in enumerate(args) if i not in declared and hasattr(a, "shape")]
    return stale

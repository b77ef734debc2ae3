"""``fp8conf precompile``: save, load, diff and show precompiled FP8 artifacts.

The model comes from ``--model package.module:factory``, a callable taking no arguments that
returns ``(model, args)`` (``load`` and ``diff`` also accept one returning the model alone)::

    fp8conf precompile save --model mypkg.models:make --out step.fp8
    fp8conf precompile load --model mypkg.models:make step.fp8          # exit 1 on a mismatch
    fp8conf precompile diff step.fp8 --model mypkg.models:make          # exit 1 when they differ
    fp8conf precompile diff old.fp8 new.fp8
    fp8conf precompile show step.fp8

``diff`` operands are artifacts or JSON files holding a signature (as ``show --json`` prints it).
Exit status: 0 success (``diff``: identical), 1 fingerprint mismatch (``diff``: different), 2 an
unreadable, corrupt or truncated artifact, or a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

__all__ = ["add_parser", "run"]


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "precompile",
        help="save, load, diff and show precompiled FP8 artifacts",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", required=True)

    def model_option(p, required):
        p.add_argument("--model", required=required, metavar="MODULE:CALLABLE", help="factory returning (model, args)")
        p.add_argument("--no-strict", dest="strict", action="store_false", help="the run is not strict (the default is strict)")

    save = actions.add_parser("save", help="trace, validate, compile and save a model's training step with its fingerprint")
    model_option(save, True)
    save.add_argument("--out", required=True, help="artifact path")
    save.add_argument("--mechanism", default="auto", choices=("auto", "standalone_compile", "graph_pickler"))

    load = actions.add_parser("load", help="load an artifact under a model's current FP8 configuration")
    model_option(load, True)
    load.add_argument("artifact")
    load.add_argument("--run", action="store_true", help="also run the loaded graph once (tangents of ones)")

    diff = actions.add_parser("diff", help="field-by-field diff of two quantization signatures")
    diff.add_argument("left", help="artifact or signature JSON file")
    diff.add_argument("right", nargs="?", help="artifact or signature JSON file (or use --model)")
    model_option(diff, False)
    diff.add_argument("--json", action="store_true", help="print the differences as JSON")

    show = actions.add_parser("show", help="print an artifact's header and signature")
    show.add_argument("artifact")
    show.add_argument("--json", action="store_true", help="print the signature as canonical JSON only")
    return parser


def _factory(spec: str):
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise SystemExit(f"fp8conf precompile: --model must be MODULE:CALLABLE, got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj()


def _model_and_args(spec: str):
    import torch

    made = _factory(spec)
    if isinstance(made, torch.nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        return made
    raise SystemExit(f"fp8conf precompile: {spec} must return (model, args) or a model, got {type(made).__qualname__}")


def _show_value(value) -> str:
    from fp8conf.artifacts.signature import ABSENT

    if value is ABSENT:
        return "<absent>"
    if isinstance(value, dict) and {"kind", "recipe", "emulate"} <= set(value):
        return f"{{kind: {value['kind']}, recipe: {value['recipe']}, emulate: {json.dumps(value['emulate'])}, {len(value.get('config', {}))} config fields}}"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def format_diff(differences) -> str:
    if not differences:
        return "the signatures are identical"
    lines = [f"{len(differences)} field{'s' if len(differences) != 1 else ''} differ:"]
    lines += [f"  {path}: {_show_value(old)} -> {_show_value(new)}" for path, old, new in differences]
    return "\n".join(lines)


def _operand(path: str):
    """``(signature, label)`` of an artifact or a signature JSON file."""
    from fp8conf.artifacts.signature import QuantizationSignature
    from fp8conf.artifacts.format import ARTIFACT_MAGIC, read_header

    with open(path, "rb") as f:
        start = f.read(len(ARTIFACT_MAGIC))
    if start == ARTIFACT_MAGIC:
        header = read_header(path)
        return header.signature, f"artifact {path} ({header.mechanism})"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict) and "signature" in data and "modules" not in data:
        data = data["signature"]
    return QuantizationSignature.from_dict(data), f"signature {path}"


def run(args) -> int:
    from fp8conf.errors import ArtifactError, FingerprintMismatchError

    try:
        return _ACTIONS[args.action](args)
    except FingerprintMismatchError as exc:
        print(f"fp8conf precompile {args.action}: fingerprint mismatch\n{exc}", file=sys.stderr)
        return 1
    except (ArtifactError, OSError, ValueError) as exc:
        print(f"fp8conf precompile {args.action}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _save(args) -> int:
    from fp8conf.artifacts.store import precompile_model

    model, model_args = _model_and_args(args.model)
    if model_args is None:
        raise SystemExit(f"fp8conf precompile save: {args.model} must return (model, args)")
    header = precompile_model(args.out, model, model_args, strict=args.strict, mechanism=args.mechanism)
    print(f"saved {args.out}: {header.mechanism}, {header.payload_size} bytes, fingerprint {header.fingerprint}")
    print(header.signature.summary())
    if header.note:
        print(f"note: {header.note}")
    return 0


def _load(args) -> int:
    import torch

    from fp8conf.artifacts.store import load_for_model

    model, model_args = _model_and_args(args.model)
    compiled = load_for_model(args.artifact, model, strict=args.strict)
    print(f"loaded {args.artifact}: {compiled.mechanism}, fingerprint {compiled.signature.sha256} matches the current configuration")
    if args.run:
        if model_args is None:
            raise SystemExit(f"fp8conf precompile load --run: {args.model} must return (model, args)")
        tangents = [torch.ones(spec["shape"], dtype=getattr(torch, spec["dtype"].removeprefix("torch."))) for spec in compiled.inputs if spec["kind"] == "tangent"]
        outputs, grads = compiled.run(model, model_args, tangents)
        print(f"ran it: {len(outputs)} output(s) of shapes {[tuple(o.shape) for o in outputs]}, {len(grads)} gradient(s)")
    return 0


def _diff(args) -> int:
    from fp8conf.artifacts.signature import QuantizationSignature

    if (args.right is None) == (args.model is None):
        raise SystemExit("fp8conf precompile diff: give a second artifact/signature file or --model, not both")
    left, left_label = _operand(args.left)
    if args.right is not None:
        right, right_label = _operand(args.right)
    else:
        model, _ = _model_and_args(args.model)
        right, right_label = QuantizationSignature.from_model(model, strict=args.strict), f"model {args.model} (strict={args.strict})"
    differences = left.diff(right)
    if args.json:
        from fp8conf.artifacts.signature import ABSENT

        plain = [{"field": p, "left": None if a is ABSENT else a, "right": None if b is ABSENT else b} for p, a, b in differences]
        print(json.dumps({"left": left.sha256, "right": right.sha256, "differences": plain}, indent=2, sort_keys=True))
    else:
        print(f"--- {left_label}  fingerprint {left.sha256[:16]}")
        print(f"+++ {right_label}  fingerprint {right.sha256[:16]}")
        print(format_diff(differences))
    return 1 if differences else 0


def _show(args) -> int:
    from fp8conf.artifacts.format import read_header

    header = read_header(args.artifact)
    if args.json:
        print(header.signature.to_json())
        return 0
    print(f"{args.artifact}: fp8conf artifact v{header.format_version}, {header.mechanism}, payload {header.payload_size} bytes, written by fp8conf {header.fp8conf_version}")
    print(f"fingerprint {header.fingerprint}")
    if header.note:
        print(f"note: {header.note}")
    print(header.signature.summary())
    print(header.signature.to_json(indent=2))
    return 0


_ACTIONS = {"save": _save, "load": _load, "diff": _diff, "show": _show}

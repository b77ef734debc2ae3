"""fp8conf precompile: save, load, diff and show precompiled FP8 artifacts, and make their keys.

An artifact is executable code: loading one runs the compiled graph it holds (Inductor's generated
code, or a pickled graph), with your permissions. fp8conf signs every artifact it saves with an
HMAC-SHA256 under your key and loads only artifacts whose MAC verifies; --trust-unsigned (which
warns) also loads one that carries no MAC, never one whose MAC does not verify. Make a key once
and point the environment at it:

    fp8conf precompile keygen --out ~/.fp8conf-artifact.key     # 32 random bytes, mode 0600
    export FP8CONF_ARTIFACT_KEY_FILE=~/.fp8conf-artifact.key    # or FP8CONF_ARTIFACT_KEY=<hex>

Whoever holds the key can write artifacts your trainers will run: keep it like a deploy credential.
A key file others may read or write is refused (chmod 600 it; FP8CONF_ARTIFACT_KEY_FILE_SHARED=1
reads it anyway, with a warning). Artifacts and key files are read only when they are regular
files; an artifact over FP8CONF_ARTIFACT_MAX_BYTES (default 4 GiB) is refused before it is read.

The model comes from --model package.module:factory, a callable taking no arguments that returns
(model, args) (load and diff also accept one returning the model alone):

    fp8conf precompile save --model mypkg.models:make --out step.fp8
    fp8conf precompile load --model mypkg.models:make step.fp8 [--run]
    fp8conf precompile diff step.fp8 --model mypkg.models:make
    fp8conf precompile diff old.fp8 new.fp8
    fp8conf precompile show step.fp8

load checks, before it deserializes anything: the digest, the MAC, the quantization fingerprint
and the shapes and dtypes of the model's parameters, buffers and (with a factory returning args)
inputs. diff operands are artifacts or JSON files holding a signature (as show --json prints it).

Exit status:
  0  success (diff: the signatures are identical)
  1  the artifact was built for another configuration: fingerprint or shapes differ (diff: different)
  2  usage or bad input: a bad argument or --model (or a model fp8conf cannot trace or validate),
     a file that is not an fp8conf artifact of this format (or not a regular file, or over the size
     bound), a key or key file that cannot be used (unreadable, not a key, others may read it),
     an --out that cannot be written (not a regular file, a read-only or full folder; nothing is
     left at it, and what was there is unchanged)
  3  integrity or authenticity: a truncated, corrupt or altered artifact, or one without a valid MAC
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

__all__ = ["add_parser", "run", "EXIT_OK", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_UNTRUSTED"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_UNTRUSTED = 0, 1, 2, 3


class _UsageError(Exception):
    """A bad argument: reported on one line, exit status 2."""


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "precompile",
        help="save, load, diff and show precompiled FP8 artifacts (executable code: signed with your key)",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", required=True)

    def model_option(p, required):
        p.add_argument("--model", required=required, metavar="MODULE:CALLABLE", help="factory returning (model, args)")
        p.add_argument("--no-strict", dest="strict", action="store_false", help="the run is not strict (the default is strict)")

    def key_option(p):
        p.add_argument("--key-file", default=None, metavar="FILE",
                       help="key to sign or verify with (default: $FP8CONF_ARTIFACT_KEY, else $FP8CONF_ARTIFACT_KEY_FILE)")

    save = actions.add_parser("save", help="trace, validate, compile and save a model's training step, signed, with its fingerprint")
    model_option(save, True)
    key_option(save)
    save.add_argument("--out", required=True, help="artifact path")
    save.add_argument("--mechanism", default="auto", choices=("auto", "standalone_compile", "graph_pickler", "regional"),
                      help="regional: only the FP8 regions compiled, the rest eager (the default auto: standalone_compile, else graph_pickler)")
    save.add_argument("--unsigned", action="store_true", help="write it without a MAC (it then loads only with --trust-unsigned)")
    save.add_argument("--remainder", default=None, choices=("inductor", "pieces", "eager"),
                      help="regional only: what becomes of the nodes outside the FP8 regions (CompileConfig.remainder; default inductor)")
    save.add_argument("--workers", default=None, type=int, metavar="N",
                      help="regional only: helper processes compiling distinct units (CompileConfig.workers; default 0)")
    save.add_argument("--repeat", default=None, metavar="CONTAINER",
                      help="trace four of the equal blocks in this container (e.g. layers) and copy the rest (trace_joint(repeat=...))")

    load = actions.add_parser("load", help="verify an artifact and load it under a model's current FP8 configuration")
    model_option(load, True)
    key_option(load)
    load.add_argument("artifact")
    load.add_argument("--run", action="store_true", help="also run the loaded graph once (tangents of ones)")
    load.add_argument("--trust-unsigned", action="store_true",
                      help="load it even when it carries no MAC (never one whose MAC does not verify): its code runs with "
                           "your permissions; only for files whose origin you trust")

    diff = actions.add_parser("diff", help="field-by-field diff of two quantization signatures")
    diff.add_argument("left", help="artifact or signature JSON file")
    diff.add_argument("right", nargs="?", help="artifact or signature JSON file (or use --model)")
    model_option(diff, False)
    diff.add_argument("--json", action="store_true", help="print the differences as JSON")

    show = actions.add_parser("show", help="print an artifact's header, signature and whether its MAC verifies")
    show.add_argument("artifact")
    key_option(show)
    show.add_argument("--json", action="store_true", help="print the signature as canonical JSON only")

    keygen = actions.add_parser("keygen", help="write a new random artifact key (hex, mode 0600; never overwrites)")
    keygen.add_argument("--out", required=True, help="key file to create")
    return parser


def _factory(spec: str):
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise _UsageError(f"--model must be MODULE:CALLABLE, got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # an import runs arbitrary module code: any failure is a bad --model
        raise _UsageError(f"--model {spec}: cannot load it ({type(exc).__name__}: {_one_line(exc)})") from None
    if not callable(obj):
        raise _UsageError(f"--model {spec}: {type(obj).__qualname__} is not callable")
    try:
        return obj()
    except Exception as exc:
        raise _UsageError(f"--model {spec}: calling it raised {type(exc).__name__}: {_one_line(exc)}") from None


def _one_line(exc) -> str:
    return " ".join(str(exc).split())[:300]


def _model_and_args(spec: str):
    import torch

    made = _factory(spec)
    if isinstance(made, torch.nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        return made
    raise _UsageError(f"--model {spec} must return (model, args) or a model, got {type(made).__qualname__}")


def _show_value(value) -> str:
    from fp8conf.artifacts.signature import ABSENT

    if value is ABSENT:
        return "<absent>"
    if isinstance(value, dict) and {"kind", "recipe", "emulate"} <= set(value):
        return f"{{kind: {value['kind']}, recipe: {value['recipe']}, emulate: {json.dumps(value['emulate'])}, {len(value.get('config', {}))} config fields}}"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."


def format_diff(differences) -> str:
    from fp8conf.artifacts.signature import describe_changes

    if not differences:
        return "the signatures are identical"
    lines = [f"changed: {line}" for line in describe_changes(differences)]
    lines.append(f"{len(differences)} field{'s' if len(differences) != 1 else ''} differ:")
    lines += [f"  {path}: {_show_value(old)} -> {_show_value(new)}" for path, old, new in differences]
    return "\n".join(lines)


def _operand(path: str):
    """``(signature, label)`` of an artifact or a signature JSON file."""
    from fp8conf.artifacts.format import parse_header
    from fp8conf.artifacts.reading import ENV_MAX_ARTIFACT_BYTES, max_artifact_bytes, read_regular_file
    from fp8conf.artifacts.signature import QuantizationSignature
    from fp8conf.errors import ArtifactError

    raw, _ = read_regular_file(
        path, name=f"diff operand {path!r}", limit=max_artifact_bytes(),
        over_limit=f"; if it is a file you expect, set {ENV_MAX_ARTIFACT_BYTES} to at least {{size}}",
        error=lambda message: ArtifactError(message, path=path),
    )
    if raw.startswith(b"FP8CONF-ARTIFACT"):
        header = parse_header(raw, path)
        return header.signature, f"artifact {path} ({header.mechanism})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _UsageError(f"{path} is neither an fp8conf artifact nor a signature JSON file ({_one_line(exc)})") from None
    if isinstance(data, dict) and "signature" in data and "modules" not in data:
        data = data["signature"]
    return QuantizationSignature.from_dict(data), f"signature {path}"


def run(args) -> int:
    from fp8conf.errors import (
        ArtifactAuthenticityError, ArtifactError, ArtifactIntegrityError, FileWriteError, FingerprintMismatchError, FP8Error, StaleArtifactError,
    )

    where = f"fp8conf precompile {args.action}"
    try:
        return _ACTIONS[args.action](args)
    except FingerprintMismatchError as exc:
        print(f"{where}: fingerprint mismatch\n{exc}", file=sys.stderr)
        return EXIT_MISMATCH
    except StaleArtifactError as exc:
        print(f"{where}: stale artifact\n{exc}", file=sys.stderr)
        return EXIT_MISMATCH
    except (ArtifactIntegrityError, ArtifactAuthenticityError) as exc:
        print(f"{where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNTRUSTED
    except (_UsageError, FileWriteError) as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ArtifactError, FP8Error, OSError) as exc:  # a model fp8conf cannot trace or validate is bad input too
        print(f"{where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _key(args) -> bytes | None:
    """The key of ``--key-file``, read before anything else is (None without the option: the
    environment's key applies)."""
    if args.key_file is None:
        return None
    from fp8conf.artifacts.keys import read_key_file

    return read_key_file(args.key_file, given_as="--key-file")


def compile_config(args):
    """The :class:`~fp8conf.CompileConfig` the options ask for, checked before anything is traced
    (a bad value is exit status 2)."""
    from fp8conf.compile import CompileConfig

    given = {name: getattr(args, name, None) for name in ("remainder", "workers")}
    return CompileConfig(strict=args.strict, **{name: value for name, value in given.items() if value is not None})


def _save(args) -> int:
    from fp8conf.artifacts.store import precompile_model

    config = compile_config(args)
    key = _key(args)
    model, model_args = _model_and_args(args.model)
    if model_args is None:
        raise _UsageError(f"--model {args.model} must return (model, args) to be traced")
    header = precompile_model(args.out, model, model_args, config, mechanism=args.mechanism,
                              key=key, unsigned=args.unsigned, repeat=args.repeat)
    signed = f"signed with key id {header.key_id}" if header.key_id else "UNSIGNED (loads only with --trust-unsigned)"
    print(f"saved {args.out}: {header.mechanism}, {header.payload_size} bytes, fingerprint {header.fingerprint}, {signed}")
    print(header.signature.summary())
    if header.note:
        print(f"note: {header.note}")
    return EXIT_OK


def _load(args) -> int:
    import torch

    from fp8conf.artifacts.format import check_artifact_path
    from fp8conf.artifacts.store import load_for_model

    key = _key(args)
    check_artifact_path(args.artifact)  # before the model is imported and built: seconds
    model, model_args = _model_and_args(args.model)
    compiled = load_for_model(args.artifact, model, model_args, strict=args.strict, key=key, trust_unsigned=args.trust_unsigned)
    checked = "parameter, buffer and input shapes" if model_args is not None else "parameter and buffer shapes"
    print(f"loaded {args.artifact}: {compiled.mechanism}; fingerprint {compiled.signature.sha256} and {checked} match the current model")
    if args.run:
        if model_args is None:
            raise _UsageError(f"load --run: --model {args.model} must return (model, args)")
        tangents = [torch.ones(spec["shape"], dtype=getattr(torch, spec["dtype"].removeprefix("torch."))) for spec in compiled.inputs if spec["kind"] == "tangent"]
        outputs, grads = compiled.run(model, model_args, tangents)
        print(f"ran it: {len(outputs)} output(s) of shapes {[tuple(o.shape) for o in outputs]}, {len(grads)} gradient(s)")
    return EXIT_OK


def _diff(args) -> int:
    from fp8conf.artifacts.signature import QuantizationSignature

    if (args.right is None) == (args.model is None):
        raise _UsageError("give a second artifact/signature file or --model, not both")
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
    return EXIT_MISMATCH if differences else EXIT_OK


def _show(args) -> int:
    from fp8conf.artifacts.format import mac_status, read_header

    key = _key(args)
    header = read_header(args.artifact)
    if args.json:
        print(header.signature.to_json())
        return EXIT_OK
    status = {
        "valid": f"signed, key id {header.key_id}: the MAC verifies under your key",
        "unsigned": "UNSIGNED: loads only with --trust-unsigned",
        "no-key": f"signed, key id {header.key_id}: not verified (no key given); load needs the key, also with --trust-unsigned",
        "invalid": f"signed, key id {header.key_id}: the MAC does NOT verify under your key; load refuses it, also with --trust-unsigned",
    }[mac_status(args.artifact, key=key)]
    print(f"{args.artifact}: fp8conf artifact v{header.format_version}, {header.mechanism}, payload {header.payload_size} bytes, written by fp8conf {header.fp8conf_version}")
    print(status)
    print(f"fingerprint {header.fingerprint}")
    if header.note:
        print(f"note: {header.note}")
    print(header.signature.summary())
    print(header.signature.to_json(indent=2))
    return EXIT_OK


def _keygen(args) -> int:
    from fp8conf.artifacts.keys import ENV_KEY_FILE, generate_key_file, key_id

    key = generate_key_file(args.out)
    print(f"wrote {args.out} (mode 0600), key id {key_id(key)}. Use it with: export {ENV_KEY_FILE}={args.out}")
    return EXIT_OK


_ACTIONS = {"save": _save, "load": _load, "diff": _diff, "show": _show, "keygen": _keygen}

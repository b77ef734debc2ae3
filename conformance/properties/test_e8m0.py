"""E8M0: the MX block-scaled matmul whose scales travel as E8M0 bytes (``uint8``, and
``float8_e8m0fnu`` where the backend takes torch's own e8m0 dtype).

Every numeric check is against :func:`conformance.draw.e8m0.reference`, which decodes the bytes in
float64 itself; the backend's op is only ever the thing under test. Operands are drawn as
:class:`conformance.draw.e8m0.E8M0Case`, so a failure prints them as runnable Python.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conformance.draw.e8m0 import A_LAYOUTS, B_LAYOUTS, BLOCK, ELEMENT_STYLES, NAN_BYTE, OUT_DTYPES, E8M0Case, fit_scale_bytes, float8_allclose, reference
from conformance.run.harness import compile_settings, fail
from conformance.report.notes import note

# A cold Inductor compile takes seconds to tens of seconds on CPU: see harness.compile_budget.
compile_budget = compile_settings()

#: The scale bytes around 1 (127) that real tensors mostly have.
ORDINARY_BYTES = st.integers(112, 142)
#: Those, the extremes (0 = 2**-127, 1 = 2**-126, 127 = 1, 254 = 2**127) and any finite byte.
FINITE_BYTES = st.one_of(ORDINARY_BYTES, st.sampled_from((127, 0, 1, 254)), st.integers(0, 254))


def _side_bytes(draw, label, rows, blocks, bases, spread):
    """Bytes of one operand: per block column a base, per row an offset of at most ``spread``."""
    base = draw(st.lists(bases, min_size=blocks, max_size=blocks), label=f"{label} bytes, per block column")
    offsets = draw(st.lists(st.integers(-spread, spread), min_size=rows * blocks, max_size=rows * blocks), label=f"{label} byte offsets")
    return [min(254, max(0, base[i % blocks] + offsets[i])) for i in range(rows * blocks)]


@st.composite
def e8m0_cases(draw, *, bytes_=FINITE_BYTES, b_bytes=None, lead=None, out_dtypes=OUT_DTYPES, max_tiles: int = 4, max_blocks: int = 4):
    """M and N multiples of 16, K a multiple of 32; scale bytes drawn per block column from
    ``bytes_`` (``b_bytes`` for b, when given) and spread over the rows (within a few binades for a
    float16 output, whose range is narrow), then fitted so outputs stay in range, keeping the bytes
    of the operand that leads each block column (``lead`` "a" or "b", or drawn per column)."""
    m = 16 * draw(st.integers(1, max_tiles), label="M / 16")
    n = 16 * draw(st.integers(1, max_tiles), label="N / 16")
    blocks = draw(st.integers(1, max_blocks), label="K / 32")
    k = BLOCK * blocks
    out_dtype = draw(st.sampled_from(out_dtypes), label="out_dtype")
    spread = 8 if out_dtype == "float16" else draw(st.sampled_from((8, 64, 254)), label="byte spread over rows")
    a_bytes = _side_bytes(draw, "a_scale", m, blocks, bytes_, spread)
    b_bytes = _side_bytes(draw, "b_scale", n, blocks, bytes_ if b_bytes is None else b_bytes, spread)
    if lead is None:
        a_leads = draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks), label="a keeps its bytes, per block column")
    else:
        a_leads = [lead == "a"] * blocks
    a_bytes, b_bytes = fit_scale_bytes(a_bytes, b_bytes, m, n, k, out_dtype, a_leads)
    return E8M0Case(
        m=m,
        n=n,
        k=k,
        out_dtype=out_dtype,
        a_bytes=a_bytes,
        b_bytes=b_bytes,
        a_style=draw(st.sampled_from(ELEMENT_STYLES), label="a elements"),
        b_style=draw(st.sampled_from(ELEMENT_STYLES), label="b elements"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        a_layout=draw(st.sampled_from(A_LAYOUTS), label="a layout"),
        b_layout=draw(st.sampled_from(B_LAYOUTS), label="b layout"),
    )


# -- helpers ---------------------------------------------------------------------------------------


def _backend_spec(backend) -> str:
    cls = type(backend)
    return f"{cls.__module__}:{cls.__qualname__}"


def _call_line(backend, case: E8M0Case) -> str:
    return (
        "from conformance.run.loading import load_backend\n"
        f"backend = load_backend({_backend_spec(backend)!r})\n"
        f"out = backend.scaled_mm_e8m0(a, b, a_scale, b_scale, torch.{case.out_dtype})"
    )


def _fail(property_id, message, case=None, backend=None, call=None):
    if case is not None:
        message += "\n\nReproducer (runnable):\n" + case.to_python(call if call is not None else _call_line(backend, case))
    fail(property_id, message)


def _check(condition, property_id, message, case=None, backend=None, call=None):
    if not condition:
        _fail(property_id, message, case, backend, call)


def _run(property_id, backend, case):
    """The backend's output for ``case``; any exception fails the property."""
    import torch

    a, b, a_scale, b_scale = case.build()
    try:
        out = backend.scaled_mm_e8m0(a, b, a_scale, b_scale, case.torch_out_dtype)
    except Exception as exc:
        _fail(property_id, f"backend {backend.name!r}: scaled_mm_e8m0() raised {type(exc).__name__}: {exc}", case, backend)
    _check(isinstance(out, torch.Tensor), property_id, f"scaled_mm_e8m0() returned {type(out).__qualname__}, expected a tensor", case, backend)
    _check(
        tuple(out.shape) == (case.m, case.n) and out.dtype == case.torch_out_dtype,
        property_id,
        f"expected an ({case.m}, {case.n}) {case.out_dtype} output, got {tuple(out.shape)} {out.dtype}",
        case,
        backend,
    )
    return out


def _check_against_reference(property_id, backend, case, out, what="the float64 dequantize-then-matmul reference"):
    """Elementwise: NaN exactly where expected, elsewhere within the reference's tolerance."""
    import torch

    expected, tolerance = reference(*case.build(), case.torch_out_dtype)
    got = out.detach().cpu().to(torch.float64)
    nan_seen, nan_expected = got.isnan(), expected.isnan()
    if not torch.equal(nan_seen, nan_expected):
        wrong = (nan_seen != nan_expected).nonzero()[:5].tolist()
        _fail(
            property_id,
            f"NaN pattern differs from {what} at (row, col) {wrong}: expected NaN "
            f"{[bool(nan_expected[i, j]) for i, j in wrong]}, saw {[got[i, j].item() for i, j in wrong]}",
            case,
            backend,
        )
    error = (got - expected).abs().nan_to_num(0.0, posinf=float("inf"))
    excess = (error - tolerance.nan_to_num(0.0)).masked_fill(nan_expected, -1.0)
    if bool((excess > 0).any()):
        i, j = divmod(int(excess.argmax()), case.n)
        count = int((excess > 0).sum())
        _fail(
            property_id,
            f"{count} of {case.m * case.n} outputs differ from {what} by more than output rounding; worst at "
            f"({i}, {j}): expected {expected[i, j].item()!r}, saw {got[i, j].item()!r}, tolerance {tolerance[i, j].item():.3g}",
            case,
            backend,
        )
    return expected, tolerance


# -- E8M0-001 --------------------------------------------------------------------------------------


#: The operands a linear layer's MX matmul gets, forced first: ``b`` as a transposed weight
#: (column-major) and a non-contiguous ``a``, every scale byte 1.0 and then spread.
LAYOUT_CASES = tuple(
    E8M0Case(m=32, n=16, k=64, a_bytes=(127,) * 64, b_bytes=tuple(120 + i % 8 for i in range(32)), a_style=style,
             b_style="normal", a_layout=a_layout, b_layout="transposed_weight", seed=7)
    for a_layout, style in (("column_major", "normal"), ("row_major", "saturating"))
)


def _enumerated_case(index: int, out_dtype: str, a_layout: str, b_layout: str) -> E8M0Case:
    """One member of the finite space of E8M0-001's dtypes and layouts: ``out_dtype`` x
    ``a_layout`` x ``b_layout``, the element styles taken in turn (each style on each side three
    times over the twelve), scale bytes spread over a few binades and fitted to the output's range."""
    m, n, blocks = 32, 16, 2
    a_bytes = tuple(118 + (7 * i) % 17 for i in range(m * blocks))
    b_bytes = tuple(121 + (5 * i) % 13 for i in range(n * blocks))
    a_bytes, b_bytes = fit_scale_bytes(a_bytes, b_bytes, m, n, BLOCK * blocks, out_dtype, [index % 2 == 0] * blocks)
    return E8M0Case(m=m, n=n, k=BLOCK * blocks, out_dtype=out_dtype, a_bytes=a_bytes, b_bytes=b_bytes,
                    a_style=ELEMENT_STYLES[index % len(ELEMENT_STYLES)], b_style=ELEMENT_STYLES[(index + 1) % len(ELEMENT_STYLES)],
                    seed=index, a_layout=a_layout, b_layout=b_layout)


#: Every output dtype with every storage of ``a`` and ``b`` (a finite space: enumerated, not drawn).
ENUMERATED_CASES = tuple(
    _enumerated_case(i, out_dtype, a_layout, b_layout)
    for i, (out_dtype, a_layout, b_layout) in enumerate(
        (d, a, b) for d in OUT_DTYPES for a in A_LAYOUTS for b in B_LAYOUTS
    )
)


def _with_examples(cases):
    """Hypothesis's ``@example`` for each of ``cases``: run before anything is drawn."""
    def decorate(test):
        for case in reversed(cases):
            test = example(case=case)(test)
        return test
    return decorate


@pytest.mark.fp8_property("E8M0-001")
@given(case=e8m0_cases())
@example(case=LAYOUT_CASES[0])
@example(case=LAYOUT_CASES[1])
@_with_examples(ENUMERATED_CASES)
def test_E8M0_001_equals_blockwise_dequantize_then_matmul(fp8_backend, case):
    """Cheapest defect: a scale bias off by one (``2**(s - 126)``), or blocks taken along the wrong
    dimension; an elementwise check on scales near 127 with small operands hides neither. The
    suite decodes every byte itself in float64, draws scale bytes 0, 1, 127 and 254 and
    elements near saturation, and compares every output within one rounding. Operands come in
    the layouts a linear layer passes (``b`` a transposed weight, ``a`` non-contiguous, forced
    first), so a kernel that reads storage as row-major whatever the strides fails. The output
    dtypes and layouts are a finite space: every dtype with every storage of ``a`` and ``b`` runs
    first (:data:`ENUMERATED_CASES`), so a kernel wrong for one of them is asked about."""
    out = _run("E8M0-001", fp8_backend, case)
    _check_against_reference("E8M0-001", fp8_backend, case, out)


# -- E8M0-002 --------------------------------------------------------------------------------------


@st.composite
def nan_cases(draw):
    """Ordinary bytes with byte 255 in a few drawn blocks of a and/or b."""
    case = draw(e8m0_cases(bytes_=ORDINARY_BYTES, max_tiles=3, max_blocks=3))
    a_bytes, b_bytes = list(case.a_bytes), list(case.b_bytes)
    a_nan = draw(st.lists(st.integers(0, len(a_bytes) - 1), max_size=3, unique=True), label="a blocks with byte 255")
    b_nan = draw(
        st.lists(st.integers(0, len(b_bytes) - 1), min_size=0 if a_nan else 1, max_size=3, unique=True),
        label="b blocks with byte 255",
    )
    for index in a_nan:
        a_bytes[index] = NAN_BYTE
    for index in b_nan:
        b_bytes[index] = NAN_BYTE
    zero = draw(st.booleans(), label="zero the elements of NaN blocks")
    return dataclasses.replace(case, a_bytes=tuple(a_bytes), b_bytes=tuple(b_bytes), zero_nan_blocks=zero)


@pytest.mark.fp8_property("E8M0-002")
@given(case=nan_cases())
def test_E8M0_002_byte_255_is_nan_in_exactly_the_outputs_using_its_block(fp8_backend, case):
    """Cheapest defect: decoding byte 255 as the number 2**128 (or NaN everywhere). Byte 255 in a
    few drawn blocks must make exactly the outputs using those blocks NaN, also when the
    block's elements are zero."""
    out = _run("E8M0-002", fp8_backend, case)
    _check_against_reference("E8M0-002", fp8_backend, case, out, what="the reference (byte 255 poisons every output using its block)")


@st.composite
def byte_0_cases(draw):
    """One operand scaled by byte 0 (2**-127) throughout, the other by large bytes (254 = 2**127
    cancels it exactly) or, for float32/bfloat16 outputs, by ordinary ones: outputs are normal
    numbers of the output dtype unless their products cancel."""
    out_dtype = draw(st.sampled_from(OUT_DTYPES), label="out_dtype")
    large = st.just(254) | st.integers(240, 254)
    partner = large if out_dtype == "float16" else (large | ORDINARY_BYTES)
    zero_side = draw(st.sampled_from(("a", "b")), label="operand with byte 0")
    sides = {"bytes_": st.just(0), "b_bytes": partner} if zero_side == "a" else {"bytes_": partner, "b_bytes": st.just(0)}
    case = draw(e8m0_cases(**sides, lead="b" if zero_side == "a" else "a", out_dtypes=(out_dtype,), max_tiles=3, max_blocks=3))
    # Offsets may have lifted some zeros: byte 0 throughout, and the partner keeps the whole budget.
    a_bytes = (0,) * len(case.a_bytes) if zero_side == "a" else case.a_bytes
    b_bytes = (0,) * len(case.b_bytes) if zero_side == "b" else case.b_bytes
    styles = st.sampled_from(("normal", "saturating", "mixed"))
    return dataclasses.replace(
        case, a_bytes=a_bytes, b_bytes=b_bytes, a_style=draw(styles, label="a elements"), b_style=draw(styles, label="b elements")
    )


@pytest.mark.fp8_property("E8M0-002")
@given(case=byte_0_cases())
def test_E8M0_002_byte_0_is_2_pow_minus_127_never_flushed(fp8_backend, case):
    """Cheapest defect: flushing byte 0 to zero (a subnormal scale treated as none). One operand is
    scaled by 2**-127 and the other by large bytes so the products are representable; outputs
    must be nonzero wherever the suite's reference is beyond the tolerance."""
    out = _run("E8M0-002", fp8_backend, case)
    expected, tolerance = _check_against_reference("E8M0-002", fp8_backend, case, out, what="the reference (byte 0 means 2**-127)")
    must_be_nonzero = expected.abs() > tolerance
    zeros = must_be_nonzero & (out.detach().cpu() == 0)
    if bool(zeros.any()):
        i, j = zeros.nonzero()[0].tolist()
        _fail(
            "E8M0-002",
            f"{int(zeros.sum())} outputs are zero where byte 0 (2**-127) gives a nonzero result: "
            f"({i}, {j}) expected {expected[i, j].item()!r}. Byte 0 must never be flushed to zero",
            case,
            fp8_backend,
        )


# -- E8M0-003 --------------------------------------------------------------------------------------


def _op(property_id, backend):
    import torch

    try:
        op = backend.e8m0_op()
    except Exception as exc:
        _fail(property_id, f"backend {backend.name!r}: e8m0_op() raised {type(exc).__name__}: {exc}")
    _check(
        isinstance(op, torch._ops.OpOverload),
        property_id,
        f"backend {backend.name!r}: e8m0_op() returned {op!r}, expected a torch._ops.OpOverload (e.g. torch.ops.ns.op.default)",
    )
    return op


@pytest.mark.fp8_property("E8M0-003")
@compile_budget
@given(case=e8m0_cases(bytes_=ORDINARY_BYTES, max_tiles=2, max_blocks=2))
def test_E8M0_003_opcheck_passes(fp8_backend, case):
    """Cheapest defect: a fake (meta) kernel with the wrong output shape, which eager runs never
    use. ``torch.library.opcheck`` runs the schema, fake and autograd registration checks, and
    the op is also called on fake tensors and must give the (M, N) ``out_dtype`` result."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = _op("E8M0-003", fp8_backend)
    operands = case.build()
    call = (
        _call_line(fp8_backend, case).rsplit("\n", 1)[0] + "\n"
        "with float8_allclose():  # CPU torch.allclose lacks float8, which opcheck's schema test uses\n"
        f"    torch.library.opcheck(backend.e8m0_op(), (a, b, a_scale, b_scale, torch.{case.out_dtype}))"
    )
    try:
        with float8_allclose():
            results = torch.library.opcheck(op, (*operands, case.torch_out_dtype))
    except Exception as exc:
        text = str(exc).strip().splitlines()
        _fail("E8M0-003", f"torch.library.opcheck({op}) failed: {type(exc).__name__}: {' '.join(text[:6])}", case, call=call)
    bad = {k: v for k, v in results.items() if v != "SUCCESS"}
    _check(not bad, "E8M0-003", f"torch.library.opcheck({op}) did not pass: {bad}", case, call=call)
    # The op the backend reports must be what its scaled_mm_e8m0 runs: trace it with fake tensors.
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in operands]
        try:
            out = fp8_backend.scaled_mm_e8m0(*fake, case.torch_out_dtype)
        except Exception as exc:
            _fail("E8M0-003", f"scaled_mm_e8m0() on fake tensors raised {type(exc).__name__}: {exc}", case, fp8_backend)
    _check(
        tuple(out.shape) == (case.m, case.n) and out.dtype == case.torch_out_dtype and out.device == operands[0].device,
        "E8M0-003",
        f"on fake tensors scaled_mm_e8m0() gives {tuple(out.shape)} {out.dtype} on {out.device}, expected "
        f"({case.m}, {case.n}) {case.out_dtype} on {operands[0].device}",
        case,
        fp8_backend,
    )


# -- E8M0-004 --------------------------------------------------------------------------------------

# Inductor spells e8m0 tensors' dtype like this in Python and C++ code.
_E8M0_DTYPE = re.compile(r"float8_e8m0|e8m0fnu", re.IGNORECASE)


def _op_nodes(graph, op) -> list:
    names = {str(op), str(op.overloadpacket), op.name()}
    return [
        n for n in graph.nodes
        if n.op == "call_function" and (n.target in (op, op.overloadpacket) or str(n.target) in names)
    ]


@pytest.mark.fp8_property("E8M0-004")
@compile_budget
@given(case=e8m0_cases(bytes_=ORDINARY_BYTES, max_tiles=2, max_blocks=2))
def test_E8M0_004_compiles_fullgraph_as_one_opaque_node(fp8_backend, warm_inductor, case):
    """Cheapest defect: an op that graph-breaks or decomposes under Dynamo, so e8m0 scales reach
    Inductor's code generator. Under ``fullgraph=True`` the step must compile into one graph
    with one op node, called once as an extern kernel, with no e8m0 dtype in the output code,
    and equal eager bitwise."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    op = _op("E8M0-004", fp8_backend)
    out_dtype = case.torch_out_dtype

    def step(a, b, a_scale, b_scale):
        return torch.relu(fp8_backend.scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype) * 2.0 + 1.0)

    call = (
        _call_line(fp8_backend, case).rsplit("\n", 1)[0] + "\n"
        "from torch._dynamo.testing import CompileCounterWithBackend\n"
        "from torch._inductor.utils import run_and_get_code\n"
        f"step = lambda a, b, a_scale, b_scale: torch.relu(backend.scaled_mm_e8m0(a, b, a_scale, b_scale, torch.{case.out_dtype}) * 2.0 + 1.0)\n"
        "counter = CompileCounterWithBackend('inductor')\n"
        "out, code = run_and_get_code(torch.compile(step, backend=counter, fullgraph=True), a, b, a_scale, b_scale)"
    )
    operands = case.build()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    try:
        out, sources = run_and_get_code(torch.compile(step, backend=counter, fullgraph=True), *operands)
    except Exception as exc:
        text = " ".join(str(exc).strip().splitlines()[:4])
        _fail(
            "E8M0-004",
            f"torch.compile(fullgraph=True) of a step calling scaled_mm_e8m0() failed (a graph break, or a dtype "
            f"Inductor cannot compile): {type(exc).__name__}: {text}",
            case,
            call=call,
        )
    finally:
        torch._dynamo.reset()
    _check(counter.frame_count == 1, "E8M0-004", f"Dynamo captured {counter.frame_count} graphs, expected exactly one (no graph break)", case, call=call)
    nodes = [n for g in counter.graphs for n in _op_nodes(g.graph, op)]
    _check(
        len(nodes) == 1,
        "E8M0-004",
        f"the captured FX graph holds {len(nodes)} calls of {op}, expected exactly one opaque node; graph:\n"
        + "\n".join(str(g.code).strip() for g in counter.graphs)[:2000],
        case,
        call=call,
    )
    code = "\n".join(sources)
    extern = code.count(f"torch.ops.{op.namespace}.{op._opname}.{op._overloadname}(")
    _check(extern == 1, "E8M0-004", f"Inductor's output code calls {op} {extern} times, expected once as an opaque extern call", case, call=call)
    seen = sorted(set(_E8M0_DTYPE.findall(code)))
    _check(not seen, "E8M0-004", f"an e8m0 dtype reaches Inductor's generated code ({seen}); pass scales as uint8", case, call=call)
    expected = step(*operands)
    _check(
        torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0)),
        "E8M0-004",
        f"the compiled step differs from eager: max abs difference {(out.float() - expected.float()).abs().nan_to_num(0.0).max().item():.3g}",
        case,
        call=call,
    )


# -- E8M0-005 --------------------------------------------------------------------------------------


def _names_argument(message: str, argument: str) -> bool:
    """Quoted (`a`, 'a', "a") or as ``argument a`` / ``a=``: a bare letter in prose does not count."""
    name = re.escape(argument)
    return bool(re.search(rf"[`'\"]{name}[`'\"]|\bargument {name}\b|(?<![\w.]){name}=", message))


def _bad_inputs(case, hp_dtype: str, scale_dtype: str, bad_k: int):
    """``(label, accepted argument names, code)`` for each bad input: ``code`` turns the case's
    operands ``a, b, a_scale, b_scale`` into the bad ones (and is the reproducer's own text)."""
    m, n, blocks = case.m, case.n, case.k // BLOCK
    padded = -(-bad_k // BLOCK)  # the scale width a kernel that pads K would want

    def scale(rows, cols):
        return f"torch.full(({rows}, {cols}), 127, dtype=torch.uint8)"

    return [
        (f"a is {hp_dtype}", {"a"}, f"a = a.to(torch.float32).to(torch.{hp_dtype})"),
        (f"b is {hp_dtype}", {"b"}, f"b = b.to(torch.float32).to(torch.{hp_dtype})"),
        ("a is float8_e5m2", {"a"}, "a = a.to(torch.float32).to(torch.float8_e5m2)"),
        ("b is float8_e5m2", {"b"}, "b = b.to(torch.float32).to(torch.float8_e5m2)"),
        (
            f"K = {bad_k}, not a multiple of 32",
            {"a", "b"},
            f"a = torch.ones({m}, {bad_k}).to(torch.float8_e4m3fn); b = torch.ones({bad_k}, {n}).to(torch.float8_e4m3fn); "
            f"a_scale = {scale(m, padded)}; b_scale = {scale(n, padded)}",
        ),
        (f"a_scale has shape {(m, blocks + 1)}", {"a_scale"}, f"a_scale = {scale(m, blocks + 1)}"),
        (f"a_scale has shape {(m + 16, blocks)}", {"a_scale"}, f"a_scale = {scale(m + 16, blocks)}"),
        (f"b_scale has shape {(n, blocks + 1)}", {"b_scale"}, f"b_scale = {scale(n, blocks + 1)}"),
        (f"b_scale has shape {(blocks, n + 16)}", {"b_scale"}, f"b_scale = {scale(blocks, n + 16)}"),
        (f"a_scale is {scale_dtype}", {"a_scale"}, f"a_scale = a_scale.to(torch.{scale_dtype})"),
        (f"b_scale is {scale_dtype}", {"b_scale"}, f"b_scale = b_scale.to(torch.{scale_dtype})"),
    ]


@pytest.mark.fp8_property("E8M0-005")
@given(
    case=e8m0_cases(bytes_=ORDINARY_BYTES, max_tiles=2, max_blocks=2),
    hp_dtype=st.sampled_from(("float32", "bfloat16", "float16")),
    scale_dtype=st.sampled_from(("float32", "int8", "int32")),
    bad_k=st.sampled_from((16, 48, 40, 8, 100)),
)
def test_E8M0_005_bad_input_raises_naming_the_argument(fp8_backend, case, hp_dtype, scale_dtype, bad_k):
    """Cheapest defect: accepting K that is not a multiple of 32 (the last partial block silently
    uses the next block's scale), or an error that does not say which argument is wrong. Each
    bad input must raise, naming ``a``, ``b``, ``a_scale`` or ``b_scale``."""
    import torch

    for label, arguments, code in _bad_inputs(case, hp_dtype, scale_dtype, bad_k):
        a, b, a_scale, b_scale = case.build()
        namespace = {"torch": torch, "a": a, "b": b, "a_scale": a_scale, "b_scale": b_scale}
        exec(code, namespace)
        operands = tuple(namespace[x] for x in ("a", "b", "a_scale", "b_scale"))
        call = f"# bad input: {label}\n{code}\n{_call_line(fp8_backend, case)}"
        try:
            out = fp8_backend.scaled_mm_e8m0(*operands, case.torch_out_dtype)
        except Exception as exc:
            message = str(exc)
            _check(
                any(_names_argument(message, name) for name in arguments),
                "E8M0-005",
                f"bad input ({label}): {type(exc).__name__} raised, but its message does not name the argument "
                f"{' or '.join(f'`{x}`' for x in sorted(arguments))}: {message[:500]}",
                case,
                call=call,
            )
            continue
        shape = tuple(getattr(out, "shape", ()))
        _fail("E8M0-005", f"bad input ({label}) was accepted: scaled_mm_e8m0() returned a {shape} result instead of raising", case, call=call)


# -- E8M0-006 --------------------------------------------------------------------------------------

#: Which scales a case passes as ``float8_e8m0fnu`` (views of the same bytes).
E8M0_VIEWS = ("a_scale", "b_scale", "both")


def _as_e8m0(scales, which: str):
    """``(a_scale, b_scale)`` with the ones ``which`` names viewed as ``float8_e8m0fnu``."""
    import torch

    a_scale, b_scale = scales
    if which in ("a_scale", "both"):
        a_scale = a_scale.view(torch.float8_e8m0fnu)
    if which in ("b_scale", "both"):
        b_scale = b_scale.view(torch.float8_e8m0fnu)
    return a_scale, b_scale


def _view_line(which: str) -> str:
    names = ("a_scale", "b_scale") if which == "both" else (which,)
    return "; ".join(f"{n} = {n}.view(torch.float8_e8m0fnu)" for n in names)


def _same_result(out, expected) -> bool:
    import torch

    return (
        tuple(out.shape) == tuple(expected.shape) and out.dtype == expected.dtype
        and torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0))
    )


def _difference(out, expected) -> str:
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        return f"a {tuple(out.shape)} {out.dtype} result against {tuple(expected.shape)} {expected.dtype}"
    nan = int((out.isnan() != expected.isnan()).sum())
    worst = (out.float() - expected.float()).abs().nan_to_num(0.0).max().item()
    return f"{nan} outputs NaN in one and not the other, max abs difference {worst:.3g}"


@st.composite
def view_cases(draw):
    """Finite bytes (0, 1, 127 and 254 among them) or ordinary ones with byte 255 in some blocks."""
    return draw(st.one_of(e8m0_cases(max_tiles=2, max_blocks=2), nan_cases()), label="case")


#: Bytes 0, 1, 127, 254 and 255 in one case, both scales e8m0: forced first.
EXTREME_VIEW_CASE = E8M0Case(m=16, n=16, k=64, out_dtype="float32", a_bytes=(0, 1, 127, 255) * 8,
                             b_bytes=(254, 253, 127, 130) * 8, a_style="normal", b_style="normal", seed=11)


@pytest.mark.fp8_property("E8M0-006")
@given(case=view_cases(), which=st.sampled_from(E8M0_VIEWS))
@example(case=EXTREME_VIEW_CASE, which="both")
def test_E8M0_006_e8m0_scales_are_the_same_bytes(fp8_backend, case, which):
    """Cheapest defect: taking ``float8_e8m0fnu`` scales by value (``scale.to(torch.uint8)`` turns
    byte ``b`` into the integer ``2**(b - 127)``, saturated), so a backend works on the bytes it
    was tested with and computes garbage on TorchAO's own scale dtype. A backend may refuse e8m0
    scales, naming the argument; if it takes them, the result must equal, NaNs included, the one
    from the same bytes as ``uint8``."""
    import torch

    expected = _run("E8M0-006", fp8_backend, case)
    a, b, a_scale, b_scale = case.build()
    a_scale, b_scale = _as_e8m0((a_scale, b_scale), which)
    call = f"{_view_line(which)}\n{_call_line(fp8_backend, case)}\nexpected = backend.scaled_mm_e8m0(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), torch.{case.out_dtype})"
    try:
        out = fp8_backend.scaled_mm_e8m0(a, b, a_scale, b_scale, case.torch_out_dtype)
    except Exception as exc:
        named = {"a_scale", "b_scale"} if which == "both" else {which}
        _check(
            any(_names_argument(str(exc), name) for name in named),
            "E8M0-006",
            f"float8_e8m0fnu scales ({which}) refused with {type(exc).__name__}, but its message does not name the "
            f"argument: {str(exc)[:500]}",
            case,
            call=call,
        )
        note(f"E8M0-006: the backend refuses float8_e8m0fnu scales ({type(exc).__name__}); only its refusal was checked")
        return
    _check(
        isinstance(out, torch.Tensor) and _same_result(out, expected),
        "E8M0-006",
        f"float8_e8m0fnu scales ({which}) give another result than the same bytes as uint8: "
        + (_difference(out, expected) if isinstance(out, torch.Tensor) else f"returned {type(out).__qualname__}")
        + "; read e8m0 scales as bytes (`scale.view(torch.uint8)`), not by value",
        case,
        call=call,
    )


def _inductor_compiles_e8m0():
    """``None`` when CPU Inductor compiles a step holding an e8m0 tensor here, else why not (the
    suite's own probe of torch: it involves no backend)."""
    import torch

    torch._dynamo.reset()
    try:
        probe = torch.compile(lambda x: x.view(torch.float8_e8m0fnu).to(torch.float32) * 2.0, backend="inductor", fullgraph=True)
        got = probe(torch.tensor([0, 127, 254], dtype=torch.uint8))
    except Exception as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).strip().splitlines()[:2])[:300]}"
    finally:
        torch._dynamo.reset()
    if got[1].item() != 2.0:
        return f"its compiled e8m0 -> float32 gives {got.tolist()} for bytes 0, 127, 254"
    return None


@pytest.mark.fp8_property("E8M0-006")
@compile_budget
@given(which=st.sampled_from(E8M0_VIEWS))
@example(which="both")
def test_E8M0_006_e8m0_scales_are_the_same_bytes_compiled(fp8_backend, warm_inductor, which):
    """Cheapest defect: a backend whose eager path views e8m0 scales as bytes while its compiled
    path converts them (a decomposition that Inductor lowers by value). Where this torch's
    Inductor compiles e8m0, a step calling ``scaled_mm_e8m0`` with e8m0 scales, compiled with
    ``fullgraph=True``, must equal eager on the same bytes as ``uint8``."""
    import torch

    case = EXTREME_VIEW_CASE
    operands = case.build()
    a, b, a_scale, b_scale = operands
    views = _as_e8m0((a_scale, b_scale), which)
    out_dtype = case.torch_out_dtype
    try:
        fp8_backend.scaled_mm_e8m0(a, b, *views, out_dtype)
    except Exception:
        note("E8M0-006: the backend refuses float8_e8m0fnu scales; nothing to compile")
        return
    why_not = _inductor_compiles_e8m0()
    if why_not is not None:
        pytest.skip(f"E8M0-006 (compiled): Inductor of torch {torch.__version__} does not compile e8m0 here ({why_not}); eager was checked")

    def step(a, b, a_scale, b_scale):
        return fp8_backend.scaled_mm_e8m0(a, b, a_scale, b_scale, out_dtype)

    expected = step(*operands)
    call = (
        f"{_view_line(which)}\n" + _call_line(fp8_backend, case).rsplit("\n", 1)[0] + "\n"
        f"step = lambda a, b, a_scale, b_scale: backend.scaled_mm_e8m0(a, b, a_scale, b_scale, torch.{case.out_dtype})\n"
        "out = torch.compile(step, backend='inductor', fullgraph=True)(a, b, a_scale, b_scale)\n"
        "expected = step(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8))"
    )
    torch._dynamo.reset()
    try:
        out = torch.compile(step, backend="inductor", fullgraph=True)(a, b, *views)
    except Exception as exc:
        text = " ".join(str(exc).strip().splitlines()[:4])
        _fail("E8M0-006", f"the backend takes float8_e8m0fnu scales eagerly, but a step passing them to scaled_mm_e8m0() "
              f"does not compile with CPU Inductor: {type(exc).__name__}: {text}", case, call=call)
    finally:
        torch._dynamo.reset()
    _check(
        _same_result(out, expected),
        "E8M0-006",
        f"compiled, float8_e8m0fnu scales ({which}) give another result than the same bytes as uint8 in eager: "
        f"{_difference(out, expected)}",
        case,
        call=call,
    )

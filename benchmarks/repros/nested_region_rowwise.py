"""torch.compile with ``torch.compiler.nested_compile_region`` on a block of TorchAO rowwise
``Float8Linear`` layers: the smallest model that fails the way the rowwise rows of
``bench_depth.py`` do (``torch.compile + nested_compile_region``), for reporting upstream.

    python benchmarks/repros/nested_region_rowwise.py [--device cuda] [--recipe rowwise]

Prints ``ok`` and exits 0 when the training step compiles and runs; otherwise prints the
exception and its innermost cause and exits 1. Seen on an H100 (torch 2.11, torchao 0.17) and on
CPU (torch 2.13, torchao 0.18) alike: ``AssertionError: aten.reshape.default with axiswise
scaling is not supported yet``, raised by TorchAO's float8 tensor inside the region's
``invoke_subgraph``, wrapped in ``BackendCompilerFailed``. The tensorwise recipe in the same
region runs (``--recipe tensorwise``).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recipe", default="rowwise", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.recipe != "tensorwise" else torch.float32
    model = torch.nn.Sequential(Block(64), Block(64)).to(args.device, dtype)
    config = Float8LinearConfig.from_recipe_name(args.recipe)
    if args.device == "cpu":
        config = Float8LinearConfig(**{**config.__dict__, "emulate": False})
    convert_to_float8_training(model, config=config)
    x = torch.randn(2, 32, 64, device=args.device, dtype=dtype, requires_grad=True)
    try:
        torch.compile(model)(x).sum().backward()
    except Exception as exc:  # the failure is what this script shows
        cause = exc
        while (getattr(cause, "inner_exception", None) or cause.__cause__) not in (None, cause):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__
        print(f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        print(f"innermost cause: {type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}")
        return 1
    print(f"ok ({args.recipe}, {args.device}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

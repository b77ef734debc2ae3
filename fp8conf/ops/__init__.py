"""fp8conf's custom ops. Importing this package registers them with ``torch.library``."""

from fp8conf.ops.e8m0 import (
    E8M0_NAN_BYTE,
    MX_BLOCK_SIZE,
    OP_NAME,
    OUT_DTYPES,
    MXArgumentError,
    apply_e8m0_scale,
    e8m0_to_float32,
    emulated_scaled_mm_e8m0,
    scaled_mm_e8m0,
    to_cublas_blocked,
    uses_cublas,
)

__all__ = [
    "OP_NAME",
    "MX_BLOCK_SIZE",
    "OUT_DTYPES",
    "E8M0_NAN_BYTE",
    "MXArgumentError",
    "scaled_mm_e8m0",
    "emulated_scaled_mm_e8m0",
    "e8m0_to_float32",
    "apply_e8m0_scale",
    "to_cublas_blocked",
    "uses_cublas",
]

"""Quantized modules: :mod:`~fp8conf.quantized.float8` (finding torchao's FP8 modules and their
configs), :mod:`~fp8conf.quantized.mx` (``MXLinear``) and :mod:`~fp8conf.quantized.ops` (the e8m0
custom op it runs on)."""

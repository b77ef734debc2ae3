"""Precompiled artifacts: :mod:`~fp8conf.artifacts.signature` (the quantization signature a
fingerprint hashes), :mod:`~fp8conf.artifacts.format` (the file layout) and
:mod:`~fp8conf.artifacts.store` (compile, save, load)."""

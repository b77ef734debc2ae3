"""The one tree of errors fp8conf raises on purpose.

Every error says *what* went wrong, *where* (module FQN, pass, node) and *what to do*. The
location is also available as attributes so that tools (and the conformance suite) can check it
without parsing the message. This module imports nothing from torch so that the conformance
plugin can name these types without loading torch.

The branches are siblings, so catching one never swallows another stage's failure::

    FP8Error
    |-- FP8ConfigError            a config or usage mistake (also a ValueError and a TypeError)
    |-- FP8TraceError             the model or its inputs cannot be traced (also a TypeError)
    |-- FP8ValidationError        a graph breaks an FP8 rule (conformance ValidationFailure)
    |   |-- MissingProvenanceError, UnsupportedLoweringError, ComputeCountError,
    |   |   `-- UndeclaredFP8ModuleError  FP8 compute in a module that declares no quantization
    |   |-- NoQuantizedModulesError
    |   |-- ScaleMismatchError    a scaled matmul's scales of another dtype, shape or layout than its scaling takes
    |   `-- WeightAllGatherError  a sharded weight gathered in another precision than the setting
    |-- FP8RegionError            an FP8 region that cannot be compiled as asked
    |   `-- IncompleteRegionError, RegionCompileError
    |-- GraphCompileError         a joint graph Inductor cannot compile whole (mode="full")
    |-- FP8GraphSplitError        a stage graph GraphPP cannot cut (conformance SplitFailure)
    |-- FileWriteError            a file fp8conf writes that cannot be written whole (also an OSError)
    |-- ArtifactError             a precompiled artifact that cannot be saved or loaded
    |   |-- ArtifactIntegrityError     truncated, corrupt or altered: its digest does not match
    |   |-- ArtifactAuthenticityError  no valid MAC under the loader's key: it may run anyone's code
    |   |-- ArtifactKeyError           a key or key file that cannot be used (also an FP8ConfigError)
    |   |   `-- KeyFilePermissionError a key file others than its owner may read or write
    |   |-- FingerprintMismatchError   built for another configuration (conformance FingerprintMismatch)
    |   `-- StaleArtifactError         built for other parameter, buffer or input shapes
    |-- MXArgumentError           an argument of an MX op or helper (also a ValueError)
    |-- MXConversionError         a module that cannot become an MXLinear (also a ValueError)
    |-- ScaledMMConversionError   a module or torch that cannot become a ScaledMMLinear (also a ValueError)
    |-- NVFP4ConversionError      a module or torch that cannot become an NVFP4Linear (also a ValueError)
    |-- GroupedExpertsError       an experts module or argument FP8 grouped experts cannot take (also a ValueError)
    `-- RankFailedError           a rank process of a check tool failed (sharded_check, pipeline_check)
        `-- ProcessGroupStartError     its process group did not start: the machine's network setup
"""

from __future__ import annotations

from fp8contract import errors as contract

__all__ = [
    "FP8Error",
    "FP8ConfigError",
    "FP8TraceError",
    "FP8ValidationError",
    "MissingProvenanceError",
    "UndeclaredFP8ModuleError",
    "UnsupportedLoweringError",
    "ComputeCountError",
    "NoQuantizedModulesError",
    "ScaleMismatchError",
    "WeightAllGatherError",
    "FP8RegionError",
    "GraphCompileError",
    "IncompleteRegionError",
    "RegionCompileError",
    "FP8GraphSplitError",
    "FileWriteError",
    "ArtifactError",
    "ArtifactIntegrityError",
    "ArtifactAuthenticityError",
    "ArtifactKeyError",
    "KeyFilePermissionError",
    "FingerprintMismatchError",
    "StaleArtifactError",
    "MXArgumentError",
    "MXConversionError",
    "ScaledMMConversionError",
    "NVFP4ConversionError",
    "GroupedExpertsError",
    "RankFailedError",
    "ProcessGroupStartError",
    "FP8ValidationWarning",
]


class FP8Error(Exception):
    """Root of every error fp8conf raises on purpose."""


class _Located:
    """Where in a graph an error is: the attributes the conformance suite reads."""

    property_id: str | None = None

    def _locate(self, module_fqn, pass_name, node_name, property_id) -> None:
        self.module_fqn = module_fqn
        self.pass_name = pass_name
        self.node_name = node_name
        if property_id is not None:
            self.property_id = property_id


class FP8ConfigError(FP8Error, ValueError, TypeError):
    """A configuration whose settings contradict each other, or an argument of the wrong kind or
    value. It is both a ``ValueError`` and a ``TypeError``, the exceptions these mistakes raised
    before they had a type of their own."""


class FP8TraceError(FP8Error, TypeError):
    """The model or its example inputs cannot be traced into a joint graph, or a graph lacks
    what tracing records (its joint signature)."""


class FP8ValidationError(_Located, FP8Error, contract.ValidationFailure):
    """A joint graph breaks an FP8 rule.

    Attributes:
        module_fqn: fully qualified name of the quantized module concerned, or ``None``.
        pass_name: ``"forward"`` or ``"backward"`` (or ``None`` when the rule is graph-wide).
        node_name: name of the offending ``torch.fx`` node, or ``None``.
        property_id: the conformance property this rule implements (``"VAL-002"``).
        findings: every finding of the run, so a caller catching the first error sees them all.
    """

    property_id = "VAL"

    def __init__(
        self,
        message: str,
        *,
        module_fqn: str | None = None,
        pass_name: str | None = None,
        node_name: str | None = None,
        property_id: str | None = None,
        findings: tuple = (),
    ):
        super().__init__(message)
        self._locate(module_fqn, pass_name, node_name, property_id)
        self.findings = tuple(findings)


class MissingProvenanceError(FP8ValidationError):
    """FP8 compute that no quantized module claims (its metadata was dropped by a rewrite)."""

    property_id = "VAL-003"


class UndeclaredFP8ModuleError(MissingProvenanceError):
    """FP8 compute issued by a module that declares no quantization (``module_fqn`` names it):
    nothing was lost, fp8conf only does not know the module. Declare it through the
    quantized-module protocol (a ``fp8_quantization()`` method, or
    ``fp8conf.register_quantized_module``)."""


class UnsupportedLoweringError(FP8ValidationError):
    """A non-emulated quantized module whose FP8 compute is missing in a pass."""

    property_id = "VAL-002"


class ComputeCountError(FP8ValidationError):
    """A quantized module issues a number of FP8 matmuls its recipe does not allow."""

    property_id = "VAL-007"


class NoQuantizedModulesError(FP8ValidationError):
    """Strict FP8 validation was requested for a graph traced from a model without FP8 modules."""

    property_id = "VAL-001"


class ScaleMismatchError(FP8ValidationError):
    """FP8 compute whose scales torch would refuse: of another dtype, shape or layout than the
    scaling its arguments declare (``aten._scaled_mm_v2``'s ``recipe_a`` / ``recipe_b`` and
    swizzles) or imply (``aten._scaled_mm``'s operand and scale shapes), or a list of scales
    whose length is not its list of recipes'. ``node_name`` is the matmul's node; the message
    names the scale, what its scaling takes and what it is. A rule of fp8conf's own (``property_id``
    ``"VAL-SCALE"``), not a property of the conformance spec."""

    property_id = "VAL-SCALE"


class WeightAllGatherError(FP8ValidationError):
    """A quantized module's sharded weight is all-gathered in another precision than the
    parallel layout's float8 all-gather setting says: in high precision although float8
    all-gather is on (FP8 silently lost on the wire), or as FP8 although it is off. Attributes
    as :class:`FP8ValidationError`'s; ``node_name`` is the all-gather's node."""

    property_id = "DP-001"


class FP8RegionError(_Located, FP8Error):
    """An FP8 region that cannot be compiled as asked. Attributes as
    :class:`FP8ValidationError`'s: ``module_fqn``, ``pass_name``, ``node_name``, ``property_id``."""

    property_id = "REG"

    def __init__(self, message: str, *, module_fqn: str | None = None, pass_name: str | None = None,
                 node_name: str | None = None, property_id: str | None = None):
        super().__init__(message)
        self._locate(module_fqn, pass_name, node_name, property_id)


class GraphCompileError(FP8Error):
    """A joint graph that Inductor cannot compile whole (``compile_joint(mode="full")``).

    Attributes:
        node_name: the graph node Inductor's lowering failed on, when it says (else None).
        target: that node's op, as text (else None).
    """

    def __init__(self, message: str, *, node_name: str | None = None, target: str | None = None):
        super().__init__(message)
        self.node_name = node_name
        self.target = target


class IncompleteRegionError(FP8RegionError):
    """An FP8 region lacks part of its quantization chain, so it must not be compiled alone."""

    property_id = "REG-004"


class RegionCompileError(FP8RegionError):
    """A tagged FP8 region that Inductor rejected, or that ended up running eagerly."""

    property_id = "NUM-003"


class FP8GraphSplitError(_Located, FP8Error, contract.SplitFailure):
    """A stage graph that GraphPP cannot cut into forward, backward-input and backward-weight
    callables without changing what it computes. Attributes: ``node_name`` (the node at the cut,
    or ``None``), ``pass_name`` (``"graphpp"``), ``module_fqn`` and ``property_id``."""

    property_id = "BND"

    def __init__(self, message: str, *, module_fqn: str | None = None, pass_name: str | None = "graphpp",
                 node_name: str | None = None, property_id: str | None = None):
        super().__init__(message)
        self._locate(module_fqn, pass_name, node_name, property_id)


class FileWriteError(FP8Error, OSError):
    """A file fp8conf writes (an artifact, a key file, a region map) that could not be written
    (:mod:`fp8contract.writing` writes every file, the suite's reports too): the path names
    something that is not a regular file (a folder, a FIFO, a device, a socket), which is left as
    it is, or the operating system refused the write (a full disk, a read-only folder). Nothing
    is left behind: no temporary file, and no empty or partial file at the path; what was there
    before is still there. It is also an ``OSError``, what these failures raised before they had
    a type of their own.

    Attributes:
        path: the path that was to be written.
        reason: why not, in the operating system's words where it gave them ("No space left on
            device", "Is a directory") or ours ("it is a FIFO, not a regular file").
        errno: the operating system's error number, or ``None`` when fp8conf refused the path itself.
    """

    def __init__(self, message: str, *, path: str, reason: str, errno: int | None = None):
        super().__init__(message)
        self.path = path
        self.reason = reason
        self.errno = errno


class ArtifactError(FP8Error):
    """A precompiled artifact that cannot be saved or loaded: not an fp8conf artifact, truncated,
    corrupt, of an unknown format, or rejected by torch's deserializer.

    Attributes:
        path: the artifact's path (or ``None``).
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class ArtifactIntegrityError(ArtifactError):
    """An artifact whose bytes are not the ones that were written: truncated, corrupt or altered
    (its sha256 digest over header and payload does not match). Nothing of it was used."""


class ArtifactAuthenticityError(ArtifactError):
    """An artifact without a valid MAC under the loader's key: unsigned, signed with another key,
    or re-signed by someone without the key. Its payload is code, so it was not deserialized.

    Attributes:
        path: the artifact's path (or ``None``).
        signed_with: the key id the artifact names (``None`` when unsigned).
        loader_key: the loader's key id (``None`` when it has no key).
    """

    def __init__(self, message: str, *, path: str | None = None, signed_with: str | None = None, loader_key: str | None = None):
        super().__init__(message, path=path)
        self.signed_with = signed_with
        self.loader_key = loader_key


class ArtifactKeyError(ArtifactError, FP8ConfigError):
    """A key that cannot sign or verify artifacts: a key file that cannot be read, is not a
    regular file or is far larger than a key, text that is not hex, too few bytes, or a key given
    where a key file's path is expected. It is also an :class:`FP8ConfigError`, what these
    mistakes raised before they had a type of their own. No message holds key material.

    Attributes:
        path: the key file's path, or ``None`` (no file, or a value that may be a key itself).
    """


class KeyFilePermissionError(ArtifactKeyError):
    """A key file that others than its owner may read or write: whoever reads the key can write
    artifacts the loader runs. Refused unless the owner says the sharing is meant
    (:func:`fp8conf.artifacts.keys.read_key_file`'s ``allow_shared``,
    ``FP8CONF_ARTIFACT_KEY_FILE_SHARED=1``).

    Attributes:
        path: the key file's path.
        mode: its permission bits (``0o644``).
    """

    def __init__(self, message: str, *, path: str, mode: int):
        super().__init__(message, path=path)
        self.mode = mode


class FingerprintMismatchError(ArtifactError, contract.FingerprintMismatch):
    """A precompiled artifact was built for another FP8 configuration than the one loading it.

    The artifact is never used. Attributes:
        path: the artifact's path (or ``None``).
        differences: ``(field_path, artifact_value, current_value)`` for every differing field of
            the two quantization signatures, sorted by field path.
        fields: the differing field paths alone.
        artifact_fingerprint / current_fingerprint: the two sha256 hex digests.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        differences: tuple = (),
        artifact_fingerprint: str | None = None,
        current_fingerprint: str | None = None,
    ):
        super().__init__(message, path=path)
        self.differences = tuple(differences)
        self.fields = tuple(d[0] for d in self.differences)
        self.artifact_fingerprint = artifact_fingerprint
        self.current_fingerprint = current_fingerprint


class StaleArtifactError(ArtifactError):
    """An artifact compiled for other shapes or dtypes of the model's parameters, buffers or
    inputs (or for parameters it no longer has) than the ones loading it. Nothing of it was used.

    Attributes:
        path: the artifact's path (or ``None``).
        differences: ``(name, artifact_value, current_value)`` per differing input, ``None``
            standing for a side that lacks it.
    """

    def __init__(self, message: str, *, path: str | None = None, differences: tuple = ()):
        super().__init__(message, path=path)
        self.differences = tuple(differences)


class MXArgumentError(FP8Error, ValueError):
    """An argument of an MX op or helper that cannot be used.

    Attributes:
        argument: the name of the offending argument (``"a"``, ``"b_scale"``, ``"out_dtype"``...).
    """

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class MXConversionError(FP8Error, ValueError):
    """A module of a model that cannot become an :class:`~fp8conf.MXLinear`.

    Attributes:
        module_fqn: fully qualified name of the module (``""`` for the root).
    """

    def __init__(self, message: str, *, module_fqn: str):
        super().__init__(message)
        self.module_fqn = module_fqn


class NVFP4ConversionError(FP8Error, ValueError):
    """A module that cannot become a :class:`~fp8conf.NVFP4Linear` (or a torch without
    ``float4_e2m1fn_x2`` or ``F.scaled_mm``), or an argument it cannot take.

    Attributes:
        module_fqn: fully qualified name of the module, when one is concerned (else None).
    """

    def __init__(self, message: str, *, module_fqn: str | None = None):
        super().__init__(message)
        self.module_fqn = module_fqn


class ScaledMMConversionError(FP8Error, ValueError):
    """A module that cannot become a :class:`~fp8conf.ScaledMMLinear` (or a torch without
    ``F.scaled_mm``), or an argument it cannot take.

    Attributes:
        module_fqn: fully qualified name of the module, when one is concerned (else None).
    """

    def __init__(self, message: str, *, module_fqn: str | None = None):
        super().__init__(message)
        self.module_fqn = module_fqn


class GroupedExpertsError(FP8Error, ValueError):
    """An experts module that cannot become a :class:`~fp8conf.Float8GroupedExperts`, or an
    argument it cannot take.

    Attributes:
        module_fqn: fully qualified name of the module, when one is concerned (else None).
    """

    def __init__(self, message: str, *, module_fqn: str | None = None):
        super().__init__(message)
        self.module_fqn = module_fqn


class RankFailedError(FP8Error):
    """A rank process that a check tool (``sharded_check``, ``pipeline_check``,
    ``tensor_parallel_check``) spawned failed for a cause that is not fp8conf's own error (which
    its launcher raises as itself): an exception of torch's or the model's, or an end without an
    error (killed, crashed in native code). Raised once by the launcher, naming the rank and the
    cause, in place of the rank's traceback.

    Attributes:
        rank: the rank that failed.
        reason: the cause, as the rank said it (``"RuntimeError: ..."``).
    """

    # Defaults, so that a rank's instance pickles back in its launcher.
    def __init__(self, message: str, *, rank: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class ProcessGroupStartError(RankFailedError):
    """The ranks' process group did not start (``torch.distributed.init_process_group``): gloo
    finds no network interface of the name ``GLOO_SOCKET_IFNAME`` gives, the host name resolves to
    an address the ranks cannot reach, a port is taken. The machine's setup, not the model or
    fp8conf; the message says what to change."""


class FP8ValidationWarning(UserWarning):
    """A validation finding reported in non-strict mode."""

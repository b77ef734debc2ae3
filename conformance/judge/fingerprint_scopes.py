"""What each fingerprint scope (``Backend.fingerprint_scope``) promises, rule by rule.

Every scope's fingerprint changes with every quantization input (FPR-001) and is equal for a
model rebuilt alike, in any process and under any ``PYTHONHASHSEED`` (FPR-002); the signature, in
every scope, ignores everything unrelated to quantization, structure and registration order
included (FPR-002, FPR-003). What a scope promises beyond that is a :class:`ScopePromises`; the
FPR tests ask it before holding a fingerprint or signature to a rule, and note what they did
not compare.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ScopePromises", "SCOPE_PROMISES", "promises_of"]


@dataclasses.dataclass(frozen=True)
class ScopePromises:
    """What a fingerprint scope promises beyond what every scope does.

    Attributes:
        registration_order: the fingerprint is equal for the model registered in reverse order
            (FPR-002).
        structure: the fingerprint ignores the structure changes of
            :data:`conformance.draw.fingerprints.STRUCTURE_KINDS` (FPR-003).
        global_inputs_in_signature: the signature holds every input of the fingerprint: a global
            change (``strict``, a version) and a relevant job setting show in it (FPR-005,
            FPR-006).
        unrelated_job_settings: the fingerprint ignores job settings unrelated to quantization
            (FPR-006).
    """

    registration_order: bool
    structure: bool
    global_inputs_in_signature: bool
    unrelated_job_settings: bool


#: Per ``Backend.fingerprint_scope``: a quantization fingerprint is the signature's digest and
#: promises everything; a whole-step key covers the step's structure and job, its signature
#: only the quantized modules.
SCOPE_PROMISES = {
    "quantization": ScopePromises(True, True, True, True),
    "whole_step": ScopePromises(False, False, False, False),
}


def promises_of(backend) -> ScopePromises:
    """What ``backend``'s declared fingerprint scope promises."""
    return SCOPE_PROMISES[getattr(backend, "fingerprint_scope", "quantization")]

"""The error protocol of the contract: exceptions the suite owns and a backend raises.

A backend raises these (or subclasses of them) where a rule says "fails": the suite catches
exactly the class a property names and nothing broader, so a split that crashes is never taken
for a validation that rejected the graph. A backend whose passes raise their own exceptions maps
them in its adapter (``raise ValidationFailure(str(exc)) from exc``); fp8conf's own errors
subclass these directly.

Location attributes are optional: a backend that knows the module, pass or node sets them; one
that does not leaves them ``None`` and names what it knows in the message. Properties that need a
location accept it either as the attribute or named in the message.
"""

from __future__ import annotations

__all__ = ["ContractError", "ValidationFailure", "SplitFailure", "FingerprintMismatch", "UnsupportedConfig"]


class ContractError(Exception):
    """Root of the exceptions the contract names."""


class ValidationFailure(ContractError):
    """Strict validation rejected a graph (``Backend.validate(gm, strict=True)``).

    Optional attributes, ``None`` when the backend does not know them:
        module_fqn: fully qualified name of the quantized module concerned.
        pass_name: ``"forward"`` or ``"backward"``.
        node_name: the offending ``torch.fx`` node's name.
        property_id: the spec property the rule implements (``"VAL-002"``).
    """

    module_fqn: str | None = None
    pass_name: str | None = None
    node_name: str | None = None
    property_id: str | None = None


class SplitFailure(ContractError):
    """A stage graph the backend cannot cut into forward, backward-input and backward-weight
    callables (``Backend.split_stage``)."""


class FingerprintMismatch(ContractError):
    """An artifact built for another quantization configuration than the one loading it
    (``Backend.load_artifact``). It must never be used.

    Optional attribute:
        fields: the differing signature field paths, when the backend knows them; otherwise the
            message names them.
    """

    fields: tuple = ()


class UnsupportedConfig(ContractError):
    """The backend's jobs cannot express the quantization configuration of the model it was
    given, so it refuses to fingerprint it or to load an artifact for it
    (``Backend.quantization_signature``, ``fingerprint``, ``load_artifact``): a trainer that builds
    each module's config from a recipe name cannot describe a ``Float8LinearConfig`` whose fields
    were changed one by one.

    The suite counts such a refusal as ``not_supported`` for the rule and change concerned, never
    as a failure, when the model holds a config the backend does not declare expressible
    (``Backend.expressible_config_fields``); refusing a model converted from named recipes is a
    failure.
    """

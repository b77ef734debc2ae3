"""Every model family runs first on the properties that draw models, and every kind of quantized
module on those that draw from their model too.

:func:`family_examples` (a decorator above a property's ``@given``) makes the family models the
property's constraints admit its first, explicit examples, in every profile, and runs each as
the backend under test can build it (:func:`served_variant`: with the recipes and emulation its
own float8 linears have). A property that also draws from its model (a module, a pass, a node:
it takes ``data``) visits only part of the models it samples under a derandomized profile (about
19 of 25), so the one model holding a kind (NVFP4, swizzled MX) may never run: there each kind
the property draws runs first as well, on the smallest of its models holding it
(:class:`KindExample`).
"""

from __future__ import annotations

import dataclasses
import functools

from conformance.draw.families import FamilySpec, variants
from conformance.draw.strategies import FLOAT8_KIND, served, smallest_of_each_kind

__all__ = ["FixedDraws", "KindExample", "family_examples", "family_specs", "served_variant"]

class FixedDraws:
    """What a property's ``data`` argument is in a family's explicit example: each draw the
    simplest value of its strategy (the first of a ``sampled_from``, the shortest list), so the
    example is the same in every run and prints as it is."""

    def draw(self, strategy, label=None):
        from hypothesis.internal.conjecture.choice import ChoiceTemplate
        from hypothesis.internal.conjecture.data import ConjectureData

        return ConjectureData.for_choices([ChoiceTemplate("simplest", count=None)]).draw(strategy)

    def __repr__(self) -> str:
        return "FixedDraws()"


@dataclasses.dataclass(frozen=True)
class KindExample:
    """An explicit example standing for the smallest model of a kind that the property samples
    (:func:`conformance.draw.strategies.smallest_of_each_kind`), known only once the backend's kinds
    are: a backend that converts no module of the kind rejects the example."""

    kind: str


def family_examples(test):
    """Decorator (above ``@given``): the property's first examples are the family models that its
    ``spec`` strategy (one of ``conformance.draw.strategies.model_specs``) admits, ``data`` (where the
    test takes it) drawing the simplest values: every family runs on every such property in
    every profile, not only when Hypothesis happens to draw it. Where the test takes ``data``,
    every other kind of module its strategy draws follows (float8 linears too where no family
    model has them). ``test.fp8_families`` lists the families, ``test.fp8_kinds`` those kinds."""
    import inspect

    from hypothesis import example

    inner = test.hypothesis.inner_test
    takes_data = "data" in inspect.signature(inner).parameters
    strategy = test.hypothesis._given_kwargs["spec"]
    specs = family_specs(strategy)
    kinds = tuple(k for k in strategy.constraints.kinds if not (specs and k == FLOAT8_KIND)) if takes_data else ()
    # Hypothesis reads the examples off the @given wrapper, last added first: add them in reverse.
    for spec in reversed(specs + tuple(KindExample(kind) for kind in kinds)):
        test = example(spec=spec, data=FixedDraws())(test) if takes_data else example(spec=spec)(test)

    @functools.wraps(inner)
    def served_examples(*args, **kwargs):
        # The examples are fixed when the module is imported; the backend's own float8 linears
        # (their recipes, their emulation) and the kinds it converts are known only now: run the
        # variant it has.
        given = kwargs.get("spec")
        if isinstance(given, KindExample):
            kwargs["spec"] = _smallest_of_kind(strategy, given.kind)
        index = next((i for i, spec in enumerate(specs) if spec is given), None)
        if index is not None:
            kwargs["spec"] = served_variant(strategy, specs[index])
        return inner(*args, **kwargs)

    test.hypothesis.inner_test = served_examples
    test.fp8_families = tuple(spec.family for spec in specs)
    test.fp8_kinds = kinds
    return test


def _smallest_of_kind(strategy, kind: str):
    """The smallest model of ``kind`` that ``strategy``'s property samples for the backend under
    test; the example is rejected where the backend converts no module of ``kind``."""
    from hypothesis import reject

    found = smallest_of_each_kind(served(strategy.constraints), strategy.where).get(kind)
    if found is None:
        reject()
    return found


def served_variant(strategy, spec: FamilySpec) -> FamilySpec:
    """The family model of ``spec``'s family that ``strategy``'s property runs against the backend
    under test (``conformance.draw.strategies.served``): ``spec`` itself for TorchAO's float8 linears,
    else the one of the recipes and emulation the backend's own have (with or without mixed
    emulation as ``spec``, when it has both)."""
    constraints = served(strategy.constraints)
    where = strategy.where
    found = [s for s in variants(constraints) if s.family == spec.family and (where is None or where(s))]
    if spec in found:
        return spec
    alike = [s for s in found if (s.emulate is None) == (spec.emulate is None)]
    return (alike or found or [spec])[0]


def family_specs(strategy) -> tuple[FamilySpec, ...]:
    """The family models a model strategy's property runs first (its constraints' variants that
    its ``where`` admits)."""
    where = strategy.where
    return tuple(spec for spec in variants(strategy.constraints) if where is None or where(spec))

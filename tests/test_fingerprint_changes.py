"""The suite's own FPR changes (conformance/draw/fingerprints.py) reach every quantization input."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.draw.fingerprints import CONFIG_FIELDS, NOT_NUMERICS, flippable
from conformance.draw.strategies import FLOAT8_RECIPES


def _leaf_paths(config, prefix=""):
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_paths(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}"


def test_every_numerics_relevant_config_field_is_flipped():
    from torchao.float8 import Float8LinearConfig

    flipped = {path for paths, _ in CONFIG_FIELDS.values() for path in paths}
    every = set(_leaf_paths(Float8LinearConfig()))
    unflipped = every - flipped - set(NOT_NUMERICS) - {"emulate"}
    assert not unflipped, f"Float8LinearConfig fields the suite never flips: {sorted(unflipped)}"
    assert flipped <= every, f"CONFIG_FIELDS names fields torchao does not have: {sorted(flipped - every)}"


@pytest.mark.parametrize("name", sorted(CONFIG_FIELDS))
def test_every_config_flip_is_drawable_for_some_recipe(name):
    assert any(flippable(recipe, (name,)) for recipe in FLOAT8_RECIPES), f"torchao rejects flipping {name} for every recipe"


def test_a_flip_from_a_custom_config_exists_for_every_recipe():
    for recipe in FLOAT8_RECIPES:
        pairs = [(a, b) for a in CONFIG_FIELDS for b in CONFIG_FIELDS if a != b and flippable(recipe, (a, b))]
        assert pairs, f"no two config fields of {recipe!r} flip together"

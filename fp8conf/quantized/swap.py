"""Swapping a model's plain ``nn.Linear`` modules for quantized ones, for the converters of
:mod:`fp8conf.quantized` (``convert_to_scaled_mm_training``, ``convert_to_nvfp4_training``,
``convert_to_mx_training``): every candidate is found and checked before any is swapped, so a
failure leaves the model unchanged, and a linear registered under two names is swapped under
both for one new module."""

from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["plain_linears", "swap_linears"]


def plain_linears(model: nn.Module, module_filter_fn, problem_of: Callable[[int, int], str | None], refuse) -> list[tuple[str, nn.Linear]]:
    """``(fqn, linear)`` of every module of exactly ``nn.Linear`` (subclasses, quantized ones
    among them, are left alone) that ``module_filter_fn(module, fqn)`` accepts, under every name it
    is registered by. ``problem_of(in_features, out_features)`` says what is wrong with a linear's
    shape (None: nothing); the first linear with a problem is ``refuse(fqn, problem)``, an
    exception to raise."""
    found = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        if type(module) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(module, fqn)):
            continue
        problem = problem_of(module.in_features, module.out_features)
        if problem:
            raise refuse(fqn, problem)
        found.append((fqn, module))
    return found


def swap_linears(model: nn.Module, found: list[tuple[str, nn.Linear]], build: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Put ``build(linear)`` in place of each of ``found`` (one new module per linear, under each
    of its names); returns ``model``, or the new module when ``model`` itself is one of them."""
    converted: dict[int, nn.Module] = {}
    for fqn, linear in found:
        if id(linear) not in converted:
            converted[id(linear)] = build(linear)
        if fqn == "":
            return converted[id(linear)]
        parent_fqn, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_fqn), name, converted[id(linear)])
    return model

"""Strict means strict in every pass: FP8 compute no quantized module can be held to is refused.

A rewrite that drops a node's provenance, or makes nodes without ``meta["val"]``, leaves scaled
matmuls that region identification cannot place in any region. Validation always refused the
first (VAL-003); strict region tagging and strict regional compilation skipped them silently and
compiled no FP8 at all. Every strict pass now raises validation's own
:class:`~fp8conf.MissingProvenanceError` naming the node; a non-strict one logs a warning through
the ``fp8conf`` logger and leaves the node eager.
"""

from __future__ import annotations

import logging

import pytest

import fp8conf
from fp8conf.graph.provenance import PROVENANCE_META_KEY
from stack_steps import traced


def _rewritten(drop: str):
    """The 2-block stack's joint graph after a rewrite that lost ``drop`` from every node."""
    _, _, gm = traced(2)
    copy = fp8conf.copy_graph_module(gm)
    for node in copy.graph.nodes:
        if drop == "provenance":
            node.meta.pop(PROVENANCE_META_KEY, None)
        elif node.op != "placeholder":
            node.meta.pop("val", None)
    return copy


def _scaled_mms(gm):
    return {n.name for n in gm.graph.nodes if "scaled_mm" in str(n.target)}


PASSES = {
    "validate_fp8_graph": lambda gm: fp8conf.validate_fp8_graph(gm),
    "tag_fp8_regions": lambda gm: fp8conf.tag_fp8_regions(gm),
    "compile_joint regional": lambda gm: fp8conf.compile_joint(gm, mode="regional"),
    "compile_joint regional, unpartitioned": lambda gm: fp8conf.compile_joint(gm, mode="regional", partition=False, remainder="eager"),
    "split_stage": lambda gm: fp8conf.split_stage(gm),
}


@pytest.mark.parametrize("drop", ["provenance", "val"])
@pytest.mark.parametrize("name", list(PASSES))
def test_a_strict_pass_refuses_fp8_compute_it_cannot_attribute(name, drop):
    gm = _rewritten(drop)
    with pytest.raises(fp8conf.MissingProvenanceError) as caught:
        PASSES[name](gm)
    error = caught.value
    assert error.property_id == "VAL-003"
    assert error.node_name in _scaled_mms(gm), error.node_name
    assert f"'{error.node_name}'" in str(error)
    assert ("provenance" if drop == "provenance" else "meta['val']") in str(error)


def test_strict_regional_compile_of_an_intact_graph_still_compiles_every_region():
    _, _, gm = traced(2)
    compiled = fp8conf.compile_joint(gm, mode="regional", remainder="eager")
    assert compiled.regions and all(r.complete for r in compiled.regions)
    assert _scaled_mms(gm) <= compiled.compiled_nodes


def test_non_strict_tagging_leaves_unattributed_compute_eager_and_logs_it(caplog):
    gm = _rewritten("provenance")
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        regions = fp8conf.tag_fp8_regions(gm, strict=False)
    assert regions == []
    said = [r.getMessage() for r in caplog.records if r.name == "fp8conf"]
    assert len(said) == len(_scaled_mms(gm)), said
    assert all("[VAL-003]" in m and "carries no provenance" in m for m in said)
    # Once per node: tagging the same graph again says nothing new.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        fp8conf.tag_fp8_regions(gm, strict=False)
    assert not [r for r in caplog.records if r.name == "fp8conf"]


def test_non_strict_regional_compile_runs_the_unattributed_compute_eagerly_and_logs_it(caplog):
    gm = _rewritten("provenance")
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        compiled = fp8conf.compile_joint(gm, mode="regional", strict=False, remainder="eager")
    assert not compiled.regions
    assert _scaled_mms(gm) <= compiled.eager_nodes
    assert any("[VAL-003]" in r.getMessage() for r in caplog.records if r.name == "fp8conf")


@pytest.mark.parametrize("drop", ["provenance", "val"])
def test_identification_says_what_it_cannot_place(drop, caplog):
    # identify_fp8_regions reads the graph only: what it skips is logged, never dropped silently.
    gm = _rewritten(drop)
    with caplog.at_level(logging.WARNING, logger="fp8conf"):
        regions = fp8conf.identify_fp8_regions(gm)
    assert regions == []
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "fp8conf")
    assert all(f"'{name}'" in said for name in _scaled_mms(gm)), said
    assert ("carries no provenance" if drop == "provenance" else "meta['val']") in said

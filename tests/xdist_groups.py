"""Tests that carry one ``xdist_group`` mark run on one xdist worker, as ``--dist loadgroup`` says.

Tests that read one run of the suite (its whole run against a backend, or the mutants of one
area) share it through a module fixture: on two workers the run would be made twice. xdist's
``loadgroup`` is meant for this, but pytest-xdist 3.8 tells the controller a test's group by
appending it to the node ID on the worker, which pytest 9.2's structured node IDs ignore: the
groups are dropped without a word (https://github.com/pytest-dev/pytest-xdist/issues/1386).

Until a release fixes that, this plugin carries the groups itself through xdist's public hooks:
the controller names a folder in each worker's ``workerinput``; each worker writes there the
node ID and group of every grouped test it collected; the controller schedules with xdist's
``LoadScopeScheduling`` whose scope is a test's group, or the test itself when it has none (as
``loadgroup`` does). It does so for ``-n`` with ``--dist load`` (the default) or ``loadgroup``;
other modes are left alone. Drop it, and pass ``--dist loadgroup``, once xdist's own works.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_INPUT_KEY = "fp8conf_xdist_groups"
_FOLDER = pytest.StashKey[Path]()
_GROUPED_MODES = ("load", "loadgroup")

_logger = logging.getLogger("fp8conf.tests")


def _group(item: pytest.Item) -> str | None:
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) for mark in item.iter_markers("xdist_group")})
    return "_".join(names) or None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller: give each worker the folder it writes its tests' groups to."""
    config = node.config
    if config.getvalue("dist") not in _GROUPED_MODES:
        return
    if _FOLDER not in config.stash:
        config.stash[_FOLDER] = Path(tempfile.mkdtemp(prefix="fp8conf-xdist-groups-"))
    node.workerinput[_INPUT_KEY] = str(config.stash[_FOLDER])


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: write ``{node ID: group}`` of the grouped tests; trylast: after deselection."""
    folder = getattr(config, "workerinput", {}).get(_INPUT_KEY)
    if folder is None:
        return
    groups = {item.nodeid: group for item in items if (group := _group(item)) is not None}
    slow = [item.nodeid for item in items if item.nodeid not in groups and item.get_closest_marker("slow")]
    path = Path(folder, f"{config.workerinput['workerid']}.json")
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"groups": groups, "slow": slow}))
    os.replace(partial, path)  # the controller never reads half a file


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Controller: schedule by group (tryfirst: before xdist's own choice of scheduler)."""
    folder = config.stash.get(_FOLDER, None)
    if folder is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, a test's scope being its group (itself when it has none).

        Groups are handed out first, in the order they are collected: each waits for runs of the
        suite that take minutes, a whole-suite run (declared first in its module) the longest;
        handed out last, one would leave a worker on it alone at the end while the other idles.
        The other tests marked ``slow`` (a run of the suite, a fresh process: tens of seconds
        each) come next, and the quick ones last, to fill in around them.
        """

        def __init__(self, config: pytest.Config, log) -> None:
            super().__init__(config, log)
            self.groups: dict[str, str] = {}
            self.slow: set[str] = set()
            self._groups_first = False

        def schedule(self) -> None:
            # Called once every worker has collected, hence written its file.
            if self.collection is None:
                for path in folder.glob("*.json"):
                    found = json.loads(path.read_text())
                    self.groups.update(found["groups"])
                    self.slow.update(found["slow"])
                _log_once(config, len(set(self.groups.values())), len(self.groups))
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self.groups.get(nodeid, nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self._groups_first:
                first_seen = {}
                for index, nodeid in enumerate(self.collection or ()):
                    first_seen.setdefault(self._split_scope(nodeid), index)
                grouped = sorted(set(self.groups.values()) & set(self.workqueue), key=first_seen.__getitem__)
                slow = sorted(self.slow & set(self.workqueue), key=first_seen.__getitem__)
                for scope in reversed(grouped + slow):
                    self.workqueue.move_to_end(scope, last=False)
                self._groups_first = True
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


def _log_once(config: pytest.Config, groups: int, tests: int) -> None:
    if groups:
        message = f"xdist: {tests} tests in {groups} xdist_group(s), each group on one worker (tests/xdist_groups.py)"
        _logger.info(message)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(message)

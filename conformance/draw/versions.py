"""Other torch and torchao versions, as every reader of a version sees them (FPR-001, FPR-004).

A backend may learn a package's version from the module (``torchao.__version__``) or, as
packaging tools and many trainers do, from the installed distribution's metadata
(``importlib.metadata.version("torchao")``, ``distribution(...).version``,
``metadata(...)["Version"]``). :func:`simulated_versions` changes both while it is open: it sets
``__version__`` and puts a distribution finder first on ``sys.meta_path`` (the hook
``importlib.metadata`` looks distributions up through), which answers for the named packages
with their installed metadata, the ``Version`` field replaced. Leaving the block removes the
finder and restores ``__version__``, also when the block raises. Nothing of torch or torchao
is replaced: the change is where readers look, not in the libraries.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.metadata
import re
import sys
from collections.abc import Iterator, Mapping

__all__ = ["current_version", "other_version", "simulated_versions"]


def _normalized(name: str) -> str:
    # PEP 503: "TorchAO", "torch_ao" and "torch-ao" name one distribution.
    return re.sub(r"[-_.]+", "-", name).lower()


def current_version(name: str) -> str:
    """The version module ``name`` reports now (its ``__version__``)."""
    return str(importlib.import_module(name).__version__)


def other_version(version: str, how: str) -> str:
    """A valid PEP 440 version other than ``version``: ``how`` ``"post"`` adds a post-release
    (``0.18.0`` -> ``0.18.0.post9``, ``2.13.0+cpu`` -> ``2.13.0.post9+cpu``), ``"local"`` a local
    label (``0.18.0+fpr.other``, ``2.13.0+cpu.fpr.other``), so that readers that parse versions
    accept it."""
    public, _, local = version.partition("+")
    if how == "post" and ".post" not in public:
        return f"{public}.post9" + (f"+{local}" if local else "")
    return f"{public}+{local + '.' if local else ''}fpr.other"


class _RenumberedDistribution(importlib.metadata.Distribution):
    """An installed distribution whose metadata names another version."""

    def __init__(self, installed: importlib.metadata.Distribution, version: str):
        self._installed, self._version = installed, version

    def read_text(self, filename):
        text = self._installed.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            text = re.sub(r"^Version:.*$", f"Version: {self._version}", text, count=1, flags=re.M)
        return text

    def locate_file(self, path):
        return self._installed.locate_file(path)


class _VersionFinder(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` for the renumbered distributions; imports nothing."""

    def __init__(self, distributions: Mapping[str, _RenumberedDistribution]):
        self._distributions = dict(distributions)

    def find_spec(self, fullname, path, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None:  # every distribution: ours come first, as the first found wins
            return iter(self._distributions.values())
        found = self._distributions.get(_normalized(name))
        return iter(() if found is None else (found,))


@contextlib.contextmanager
def simulated_versions(versions: Mapping[str, str]) -> Iterator[None]:
    """While open, the modules and distributions named in ``versions`` (``{"torchao":
    "0.18.0.post9"}``) report those versions, through ``__version__`` and through
    ``importlib.metadata``. A module without installed metadata changes its ``__version__`` only."""
    saved = []
    distributions = {}
    finder = None
    try:
        for name, version in versions.items():
            module = importlib.import_module(name)
            original = module.__version__
            saved.append((module, original))
            module.__version__ = _version_like(original, version)
            try:
                installed = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            distributions[_normalized(name)] = _RenumberedDistribution(installed, version)
        if distributions:
            finder = _VersionFinder(distributions)
            sys.meta_path.insert(0, finder)
        yield
    finally:
        if finder is not None:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
        for module, original in reversed(saved):
            module.__version__ = original


def _version_like(original, version: str):
    try:  # keep torch.__version__ a TorchVersion, comparable as before
        return type(original)(version)
    except Exception:
        return version

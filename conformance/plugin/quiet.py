"""Captured logs without the libraries' own chatter.

A failing property's captured log is read to find what the backend did. torch's structured
trace logger (``torch.__trace``) emits an empty DEBUG record per traced graph, and torchao
logs at import that its CUDA extensions did not load on this machine and that it registers
its enums with pytree: thousands of lines that say nothing about the backend under test. The
plugin installs :class:`LibraryChatterFilter` on pytest's log capture handlers for a run with
``--fp8-backend`` only, and on the torchao and pytree loggers whose notices torch's logging
prints to stderr; ``torch.__trace`` itself is left alone, so ``TORCH_TRACE`` still works.
"""

from __future__ import annotations

import logging
from typing import Callable

import pytest

__all__ = ["LibraryChatterFilter", "install"]

#: (logger name prefix, text in the message) of records that are dropped; "" drops all.
_CHATTER = (
    ("torch.__trace", ""),
    ("torchao", "Failed to load"),
    ("torchao", "Skipping import of cpp extensions"),
    ("torchao.kernel", "Detected no triton"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)
#: Loggers whose own records are notices only: filtered at the logger, so stderr is quiet too.
_NOTICE_LOGGERS = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")
#: Attributes of pytest's logging plugin that hold a handler capturing records.
_HANDLERS = ("caplog_handler", "report_handler", "log_cli_handler", "log_file_handler")


class LibraryChatterFilter(logging.Filter):
    """Drops torch tracing records and torchao's load-time notices; passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        for prefix, text in _CHATTER:
            if record.name == prefix or record.name.startswith(prefix + "."):
                if not text or text in record.getMessage():
                    return False
        return True


def install(config: pytest.Config) -> Callable[[], None]:
    """Add the filter to the handlers of pytest's logging plugin and to the notice loggers
    (call at session start); returns what removes it again."""
    chatter = LibraryChatterFilter()
    filtered: list[logging.Filterer] = [logging.getLogger(name) for name in _NOTICE_LOGGERS]
    plugin = config.pluginmanager.get_plugin("logging-plugin")  # None under -p no:logging
    for name in _HANDLERS:
        handler = getattr(plugin, name, None)
        if isinstance(handler, logging.Handler):
            filtered.append(handler)
    for target in filtered:
        target.addFilter(chatter)

    def remove() -> None:
        for target in filtered:
            target.removeFilter(chatter)

    return remove

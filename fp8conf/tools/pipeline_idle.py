"""The share of a pipeline step a rank sits idle, from one ``torch.profiler`` trace of the step.

Definition: the step's window is the wall-clock range of the ``record_function`` labelled
:data:`STEP_LABEL` that wraps ``schedule.step`` (and the device synchronisation after it) on that
rank. A rank is *busy* while it computes, and *idle* the rest of the window::

    idle share = 1 - |union of the rank's compute intervals, clipped to the window| / |window|

Compute intervals are, on a GPU, the device activities of that rank's trace (kernels, copies,
fills) other than NCCL's, whose kernels spin while they wait for the peer, and other than the
``record_function`` labels the profiler mirrors onto the device's timeline; on CPU, the operators
run under the step's label other than communication (``c10d::``, ``gloo:``, ``nccl:``) and its
children, and other than ``torch.distributed.pipelining``'s ``record_function`` labels per action
(``PP:...``, ``Forward <i>``, ``Backward <i>``), which wrap the waits for a peer's activation or
gradient as well as the compute (labels of compute, such as a compiled graph's call, count). A union, not a sum, so
nested operators and concurrent streams count once.

So on a GPU the share is the fraction of the step its device has nothing but communication to
run: the pipeline's bubble plus any host-bound gap. On CPU it also counts the host work between
operators (the schedule's bookkeeping, Python), and with ranks sharing cores it shows contention
for them as well as the bubble; it is not what separate devices would show.
"""

from __future__ import annotations

import re

from torch.autograd import DeviceType

__all__ = ["STEP_LABEL", "idle_share"]

STEP_LABEL = "fp8conf.pipeline.step"
_COMMUNICATION = ("c10d::", "gloo:", "nccl:")
# The labels torch.distributed.pipelining's schedules put around each action they run.
_SCHEDULE_ACTION = re.compile(r"PP:|(Forward|Backward) \d+$")


def _window(events):
    steps = [e for e in events if e.name == STEP_LABEL and e.device_type == DeviceType.CPU]
    if len(steps) != 1:
        raise ValueError(f"expected one {STEP_LABEL!r} range in the trace, found {len(steps)}")
    return steps[0]


def _under(event, ancestor) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent is ancestor:
            return True
        parent = parent.cpu_parent
    return False


def _host_compute(event, step) -> bool:
    if event.device_type != DeviceType.CPU or event is step or not _under(event, step):
        return False
    node = event
    while node is not step:
        if node.name.startswith(_COMMUNICATION):
            return False
        node = node.cpu_parent
    return not _SCHEDULE_ACTION.match(event.name)


def _device_compute(event) -> bool:
    # record_function labels also appear on the device's timeline (spanning the kernels run
    # under them, waits included): they are annotations, not activity.
    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return False
    return event.name != STEP_LABEL and not _SCHEDULE_ACTION.match(event.name) and "nccl" not in event.name.lower()


def _covered(intervals, start, end) -> float:
    covered, reach = 0.0, start
    for lo, hi in sorted((max(lo, start), min(hi, end)) for lo, hi in intervals):
        if hi <= reach:
            continue
        covered += hi - max(lo, reach)
        reach = hi
    return covered


def idle_share(events, *, device: str) -> float:
    """Idle share of one rank's step (see the module docstring) from ``profile.events()``;
    ``device`` is ``"cpu"`` or a CUDA device, the one the rank computed on."""
    step = _window(events)
    start, end = step.time_range.start, step.time_range.end
    if device == "cpu":
        busy = [e.time_range for e in events if _host_compute(e, step)]
    else:
        busy = [e.time_range for e in events if _device_compute(e)]
    covered = _covered([(r.start, r.end) for r in busy], start, end)
    return max(0.0, 1.0 - covered / (end - start)) if end > start else 0.0

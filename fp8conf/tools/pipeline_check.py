"""A self-checking GraphPP pipeline under ``torch.distributed.pipelining``: ``python -m fp8conf.pipeline``.

Cuts a stack of FP8 blocks (:mod:`fp8conf.tools.example_models`) into ``ranks x stages-per-rank``
:class:`fp8conf.pipeline.GraphPPStage` s, runs one training step of the chosen schedule of
``torch.distributed.pipelining.schedules`` in ``ranks`` processes, and checks, against the same
microbatches run unsplit in one process (each stage's joint graph):

- every parameter gradient (bitwise on CPU);
- the FP8 casts per stage: those in the callables the schedule ran equal those of the unsplit
  stage graph, so no tensor was cast again because a schedule ran dW apart from dI;
- that every stage ran forward, dI and dW once per microbatch;

and, from one more step run under ``torch.profiler``, the share of the step each rank sat idle
(:mod:`fp8conf.tools.pipeline_idle` defines it).

::

    python -m fp8conf.pipeline --backend gloo --schedule ZBVZeroBubble --stages-per-rank 2
    python -m fp8conf.pipeline --backend nccl --schedule Interleaved1F1B --stages-per-rank 2 --compile regional
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

from fp8conf.errors import FP8ConfigError, FP8Error
from fp8conf.graph.roles import OpRole, classify_node
from fp8conf.graph.trace import joint_signature, run_joint, trace_joint
from fp8conf.pipeline.stage import CHECKED_SCHEDULES, GraphPPStage
from fp8conf.tools import ranks as rank_processes
from fp8conf.tools.pipeline_idle import STEP_LABEL, idle_share

__all__ = ["PipelineCheck", "launch", "main", "stage_modules", "stage_indices"]

# Both V-shaped schedules place stage r and stage 2N-1-r on rank r of N.
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@dataclasses.dataclass
class PipelineCheck:
    """One step of a schedule compared with the same microbatches run unsplit in one process."""

    backend: str
    device: str
    schedule: str
    ranks: int
    stages_per_rank: int
    compile: str | None
    microbatches: int
    parameters: int
    bitwise_equal: bool
    max_abs_diff: float
    max_abs_diff_vs_eager_autograd: float
    #: FP8 casts in the callables the schedule ran, per stage, and in the unsplit stage graphs
    #: over the same microbatches.
    casts_run: dict[int, int]
    casts_unsplit: dict[int, int]
    #: Every stage ran forward, dI and dW exactly once per microbatch.
    each_part_once: bool
    #: W actions the schedule ran apart from their I (0 for schedules with full backwards only).
    deferred_weight_steps: int
    #: Median step time in seconds (slowest rank), and of the unsplit and eager autograd steps.
    step_s: float
    unsplit_step_s: float
    eager_step_s: float
    #: Per rank, the share of a profiled step it computed nothing (see :mod:`fp8conf.tools.pipeline_idle`).
    idle_share: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def casts_equal(self) -> bool:
        return self.casts_run == self.casts_unsplit

    def summary(self) -> str:
        verdict = (
            "gradients bitwise equal to the unsplit step"
            if self.bitwise_equal
            else f"gradients differ from the unsplit step: max |diff| {self.max_abs_diff:.3g}"
        )
        return (
            f"{self.schedule} pipeline over {self.backend} on {self.device}: {self.ranks} ranks x {self.stages_per_rank} "
            f"stages, {self.microbatches} microbatches, compile={self.compile}, {self.deferred_weight_steps} W steps "
            f"deferred from their I; {self.parameters} parameter gradients: {verdict}; vs eager autograd max |diff| "
            f"{self.max_abs_diff_vs_eager_autograd:.3g}; FP8 casts per stage run {sum(self.casts_run.values())}, "
            f"unsplit {sum(self.casts_unsplit.values())} (equal: {self.casts_equal}); each part once per "
            f"microbatch: {self.each_part_once}; idle share per rank "
            f"{' / '.join(f'{v:.2f}' for _, v in sorted(self.idle_share.items()))}"
        )


class _Sequential(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stage_modules(model, num_stages: int) -> list[torch.nn.Module]:
    """Cut an :class:`fp8conf.tools.example_models.BlockStack` into ``num_stages`` stage modules of
    consecutive blocks (the head, if any, joins the last); parameters are shared, not copied."""
    blocks = list(model.blocks)
    if not 1 <= num_stages <= len(blocks):
        raise FP8ConfigError(f"cannot cut {len(blocks)} blocks into {num_stages} stages; use at least as many --blocks as stages")
    bounds = [round(i * len(blocks) / num_stages) for i in range(num_stages + 1)]
    stages = [blocks[bounds[i] : bounds[i + 1]] for i in range(num_stages)]
    if model.head is not None:
        stages[-1].append(model.head)
    return [_Sequential(layers) for layers in stages]


def stage_indices(schedule: str, rank: int, ranks: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``rank`` holds under ``schedule``: looped (``rank``, ``rank + ranks``, ...)
    or, for the V-shaped schedules, ``rank`` and ``2 * ranks - 1 - rank``."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    try:
        cls = get_schedule_class(schedule)
    except ValueError as e:
        raise FP8ConfigError(f"{e}; those checked with GraphPP stages: {', '.join(CHECKED_SCHEDULES)}") from None
    if issubclass(cls, PipelineScheduleSingle) and stages_per_rank != 1:
        raise FP8ConfigError(f"{schedule} runs one stage per rank; use --stages-per-rank 1 or a multi-stage schedule")
    if schedule in _V_SHAPED:
        if stages_per_rank != 2:
            raise FP8ConfigError(f"{schedule} runs exactly two stages per rank (V-shaped); use --stages-per-rank 2")
        return [rank, 2 * ranks - 1 - rank]
    return [rank + i * ranks for i in range(stages_per_rank)]


def _problem(options, device):
    """``(stage modules, batch, target)``: ``options["problem"]``'s, when given, else an FP8 block
    stack's cut into the stages, with random activations and targets."""
    num_stages = options["ranks"] * options["stages_per_rank"]
    if options.get("problem") is not None:
        return options["problem"](options, num_stages, device)
    from fp8conf.tools.example_models import build_stack

    model = build_stack(options["dim"], options["blocks"], options["recipe"], device=device)
    generator = torch.Generator().manual_seed(1)
    shape = (options["microbatches"] * options["tokens"], options["dim"])
    batch = torch.randn(shape, generator=generator).to(device)
    target = torch.randn(shape, generator=generator).to(device)
    return stage_modules(model, num_stages), batch, target


def _loss(output, target):
    # Integer targets are token ids (a language model's logits); others are regression targets.
    if not target.is_floating_point():
        return torch.nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    return torch.nn.functional.mse_loss(output, target)


def _step(schedule, stages, batch, target):
    for stage in stages:
        stage.submod.zero_grad(set_to_none=True)
        stage.runs.clear()
    args = (batch,) if any(s.is_first for s in stages) else ()
    schedule.step(*args, target=target if any(s.is_last for s in stages) else None)
    _synchronize(batch)


def _profiled_idle_share(schedule, stages, batch, target, device) -> float:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        with record_function(STEP_LABEL):
            _step(schedule, stages, batch, target)
    return idle_share(prof.events(), device=device)


def _worker(rank, ranks, init_file, options, result_dir):
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    device = f"cuda:{rank}" if options["backend"] == "nccl" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(rank)
    rank_processes.start_process_group(options["backend"], init_file, rank, ranks)
    try:
        modules, batch, target = _problem(options, device)
        num_stages = ranks * options["stages_per_rank"]
        mine = stage_indices(options["schedule"], rank, ranks, options["stages_per_rank"])
        examples = _stage_examples(modules, batch, options["microbatches"])
        stages = [GraphPPStage(modules[i], i, num_stages, device, examples[i], compile=options["compile"]) for i in mine]
        cls = get_schedule_class(options["schedule"])
        schedule = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, options["microbatches"], loss_fn=_loss)
        times = []
        for _ in range(options["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            _step(schedule, stages, batch, target)
            dist.barrier()
            times.append(time.perf_counter() - start)
        # One more step, profiled, after the timed ones: the profiler's overhead stays out of the
        # step times, and this step's gradients (the same, .grad reset) are the ones checked.
        dist.barrier()
        idle = _profiled_idle_share(schedule, stages, batch, target, device)
        dist.barrier()
        result = {
            "grads": {(s.stage_index, fqn): p.grad.cpu() for s in stages for fqn, p in s.submod.named_parameters()},
            "runs": {s.stage_index: list(s.runs) for s in stages},
            "casts_run": {s.stage_index: _casts_run(s) for s in stages},
            "times": times,
            "idle_share": idle,
        }
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    rank_processes.leave()


def _casts(gm) -> int:
    return sum(1 for n in gm.graph.nodes if classify_node(n) is OpRole.CAST)


def _casts_run(stage: GraphPPStage) -> int:
    per_part = {name: _casts(part) for name, part in stage.split.parts.items()}
    return sum(per_part[part] for part, _ in stage.runs)


def _each_part_once(runs: dict[int, list], microbatches: int) -> bool:
    expected = collections.Counter((part, mb) for part in ("forward", "backward_input", "backward_weight") for mb in range(microbatches))
    return all(collections.Counter(stage_runs) == expected for stage_runs in runs.values())


def _deferred_weight_steps(runs: dict[int, list]) -> int:
    # A W is deferred when something else ran between it and its own I on that stage.
    deferred = 0
    for stage_runs in runs.values():
        for i, (part, mb) in enumerate(stage_runs):
            if part == "backward_weight" and stage_runs[i - 1] != ("backward_input", mb):
                deferred += 1
    return deferred


def _stage_examples(stages, batch, microbatches) -> list[torch.Tensor]:
    """Each stage's input for the first microbatch: a stage's input may differ from the batch in
    shape and dtype (token ids into an embedding), so it is what the stages before it return."""
    examples = [batch.tensor_split(microbatches)[0]]
    with torch.no_grad():
        for module in stages[:-1]:
            examples.append(module(examples[-1]))
    return examples


def _unsplit_graphs(stages, batch, microbatches):
    examples = _stage_examples(stages, batch, microbatches)
    return [trace_joint(m, (x.detach().clone().requires_grad_(i > 0),)) for i, (m, x) in enumerate(zip(stages, examples))]


def _synchronize(tensor):
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _zero_output_grad(gm, like):
    # The stage's output may differ from its input in shape and dtype (a language model's
    # embedding and head): the tangent placeholder's traced value says which.
    tangent = list(gm.graph.find_nodes(op="placeholder"))[joint_signature(gm).num_primals].meta["val"]
    return torch.zeros(tangent.shape, dtype=tangent.dtype, device=like.device)


def _unsplit_step(stages, graphs, batch, target, microbatches):
    """The same microbatches through each stage's unsplit joint graph, in one process, with the
    schedule's loss and its gradient scaling (the mean over microbatches)."""
    grads: dict[tuple[int, str], torch.Tensor] = {}
    start = time.perf_counter()
    for x, t in zip(batch.tensor_split(microbatches), target.tensor_split(microbatches)):
        acts = [x]
        for i, (module, gm) in enumerate(zip(stages, graphs)):
            # The joint graph needs its output's gradient as an input; this first call only
            # produces the output, for the next stage and the loss.
            (y,), _ = run_joint(gm, module, (acts[-1].detach().requires_grad_(i > 0),), (_zero_output_grad(gm, acts[-1]),))
            acts.append(y)
        y = acts[-1].detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(_loss(y, t), y)
        for i in reversed(range(len(stages))):
            _, stage_grads = run_joint(graphs[i], stages[i], (acts[i].detach().requires_grad_(i > 0),), (grad,))
            for fqn, g in stage_grads.items():
                if not fqn.startswith("input."):
                    grads[(i, fqn)] = g.clone() if (i, fqn) not in grads else grads[(i, fqn)].add_(g)
            grad = stage_grads.get("input.0")
    for g in grads.values():
        g.div_(microbatches)
    _synchronize(batch)
    return grads, time.perf_counter() - start


def _eager_step(stages, batch, target, microbatches):
    for module in stages:
        module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for x, t in zip(batch.tensor_split(microbatches), target.tensor_split(microbatches)):
        y = x
        for module in stages:
            y = module(y)
        _loss(y, t).backward()
    _synchronize(batch)
    elapsed = time.perf_counter() - start
    grads = {(i, fqn): p.grad.clone() / microbatches for i, m in enumerate(stages) for fqn, p in m.named_parameters()}
    for module in stages:
        module.zero_grad(set_to_none=True)
    return grads, elapsed


def _compare(options, results, device_name):
    # The reference runs on the device the ranks ran on (the first GPU under NCCL): a CPU
    # reference for a GPU pipeline would compare kernels, not the pipeline.
    stages, batch, target = _problem(options, "cuda:0" if options["backend"] == "nccl" else "cpu")
    m = options["microbatches"]
    graphs = _unsplit_graphs(stages, batch, m)
    unsplit_times, eager_times = [], []
    for _ in range(options["repeats"]):
        reference, elapsed = _unsplit_step(stages, graphs, batch, target, m)
        unsplit_times.append(elapsed)
        eager, elapsed = _eager_step(stages, batch, target, m)
        eager_times.append(elapsed)
    reference = {k: v.cpu() for k, v in reference.items()}
    eager = {k: v.cpu() for k, v in eager.items()}
    pipeline = {k: v for r in results for k, v in r["grads"].items()}
    runs = {k: v for r in results for k, v in r["runs"].items()}
    diff = max((pipeline[k].float() - reference[k].float()).abs().max().item() for k in reference)
    eager_diff = max((pipeline[k].float() - eager[k].float()).abs().max().item() for k in eager)
    step_times = [max(times) for times in zip(*(r["times"] for r in results))]
    return PipelineCheck(
        backend=options["backend"], device=device_name, schedule=options["schedule"], ranks=options["ranks"],
        stages_per_rank=options["stages_per_rank"], compile=options["compile"], microbatches=m, parameters=len(reference),
        bitwise_equal=pipeline.keys() == reference.keys() and all(torch.equal(pipeline[k], reference[k]) for k in reference),
        max_abs_diff=diff, max_abs_diff_vs_eager_autograd=eager_diff,
        casts_run={k: v for r in results for k, v in r["casts_run"].items()},
        casts_unsplit={i: _casts(gm) * m for i, gm in enumerate(graphs)},
        each_part_once=_each_part_once(runs, m) and len(runs) == len(stages),
        deferred_weight_steps=_deferred_weight_steps(runs),
        step_s=statistics.median(step_times), unsplit_step_s=statistics.median(unsplit_times), eager_step_s=statistics.median(eager_times),
        idle_share={rank: r["idle_share"] for rank, r in enumerate(results)},
    )


def launch(*, schedule: str = "ZBVZeroBubble", ranks: int = 2, stages_per_rank: int | None = None, microbatches: int = 4,
           backend: str = "gloo", dim: int = 64, blocks: int | None = None, tokens: int = 32, recipe: str = "tensorwise",
           compile: str | None = None, repeats: int = 1, problem=None) -> PipelineCheck:
    """Spawn ``ranks`` processes, run ``repeats`` timed steps of ``schedule`` and one profiled step,
    and return the check of the last. ``stages_per_rank`` defaults to 2 for the V-shaped schedules
    and 1 otherwise; ``blocks`` to one per stage. ``problem``, a picklable callable
    ``(options, num_stages, device) -> (stage modules, batch, target)``, replaces the FP8 block
    stack (integer targets are token ids, taken with cross-entropy). A failed rank raises one error
    naming the cause (:func:`fp8conf.tools.ranks.spawn`)."""
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule in _V_SHAPED else 1
    stage_indices(schedule, 0, ranks, stages_per_rank)  # a usage mistake fails here, not in every process
    if schedule in _V_SHAPED and backend == "gloo":
        from fp8conf.torch_internals import v_schedules_start_on_gloo

        starts = v_schedules_start_on_gloo()
        if not starts.found:
            raise FP8ConfigError(f"{schedule} cannot start over gloo with torch {torch.__version__} ({starts.reason}); "
                                 "run it with --backend nccl or a looped schedule (Interleaved1F1B), or on a newer torch (2.13 warms up by a vote)")
    options = dict(schedule=schedule, ranks=ranks, stages_per_rank=stages_per_rank, microbatches=microbatches, backend=backend,
                   dim=dim, blocks=blocks or ranks * stages_per_rank, tokens=tokens, recipe=recipe, compile=compile, repeats=repeats,
                   problem=problem)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        rank_processes.spawn(_worker, (ranks, init_file, options, tmp), ranks=ranks, tool="pipeline_check")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(ranks)]
    device_name = torch.cuda.get_device_name(0) if backend == "nccl" else "CPU"
    return _compare(options, results, device_name)


def _parser() -> argparse.ArgumentParser:
    schedules = "; ".join(f"{name} ({what})" for name, what in CHECKED_SCHEDULES.items())
    parser = argparse.ArgumentParser(
        prog="python -m fp8conf.pipeline",
        description="Run one step of a torch.distributed.pipelining schedule over FP8 GraphPP stages and check every "
        "parameter gradient and the FP8 casts per stage against the same microbatches run unsplit in one process.",
        epilog=f"Schedules run and checked: {schedules}.",
    )
    parser.add_argument("--schedule", default="ZBVZeroBubble", help="a torch.distributed.pipelining schedule name (default ZBVZeroBubble)")
    parser.add_argument("--ranks", type=rank_processes.rank_count, default=2, help="processes, one pipeline rank each (default 2)")
    parser.add_argument("--stages-per-rank", type=int, default=None, help="default 2 for the V-shaped schedules, else 1")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="gloo: CPU; nccl: one GPU per rank")
    parser.add_argument("--compile", choices=["regional", "full"], default=None, help="compile each callable (default eager)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=None, help="FP8 blocks in the model (default one per stage)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        check = launch(schedule=args.schedule, ranks=args.ranks, stages_per_rank=args.stages_per_rank,
                       microbatches=args.microbatches, backend=args.backend, dim=args.dim, blocks=args.blocks,
                       tokens=args.tokens, recipe=args.recipe, compile=args.compile)
    except FP8Error as exc:
        print(f"pipeline_check: {rank_processes.one_line(exc)}", file=sys.stderr)
        return 2
    print(check.summary())
    # Eager stages must match bitwise; Inductor's kernels may round float32 differently from
    # eager ones, in a compiled region (seen on CUDA: 2e-6) or the compiled remainder between
    # regions (on CPU: 2e-10).
    numerics = check.bitwise_equal or (args.compile and check.max_abs_diff <= 1e-4)
    return 0 if numerics and check.casts_equal and check.each_part_once else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Running GraphPP callables as pipeline stages over ``torch.distributed``
(:mod:`fp8conf.pipeline.stage`); ``python -m fp8conf.pipeline`` runs a self-checking demo."""

from fp8conf.pipeline.stage import PipelineStage, run_schedule, stage_modules, zero_bubble_schedule

__all__ = ["PipelineStage", "zero_bubble_schedule", "run_schedule", "stage_modules"]

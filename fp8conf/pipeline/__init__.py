"""GraphPP stages for ``torch.distributed.pipelining``'s schedules (:mod:`fp8conf.pipeline.stage`);
``python -m fp8conf.pipeline`` runs a schedule over them and checks it
(:mod:`fp8conf.tools.pipeline_check`)."""

from fp8conf.pipeline.stage import CHECKED_SCHEDULES, GraphPPStage

__all__ = ["GraphPPStage", "CHECKED_SCHEDULES"]

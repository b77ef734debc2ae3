"""Sharded training steps the FP8 passes can see: parameters laid out over ranks with torch's
``DTensor``, gathered and reduced through functional collectives inside the traced step.

:func:`shard_data_parallel` (:mod:`fp8conf.parallel.data_parallel`) shards a model data-parallel,
with or without float8 all-gather; :func:`shard_tensor_parallel`
(:mod:`fp8conf.parallel.tensor_parallel`) shards its linears tensor-parallel with TorchAO's FP8
styles; :class:`ParallelLayout` (:mod:`fp8conf.parallel.layout`) is what each records on the model.
"""

from fp8conf.parallel.layout import LAYOUT_ATTRIBUTE, ParallelLayout, ShardedParameter, layout_of

__all__ = ["LAYOUT_ATTRIBUTE", "ParallelLayout", "ShardedParameter", "layout_of", "shard_data_parallel", "shard_tensor_parallel"]


def __getattr__(name: str):
    if name == "shard_data_parallel":  # torch.distributed loads on first use, not with the package
        from fp8conf.parallel.data_parallel import shard_data_parallel

        return shard_data_parallel
    if name == "shard_tensor_parallel":
        from fp8conf.parallel.tensor_parallel import shard_tensor_parallel

        return shard_tensor_parallel
    raise AttributeError(f"module 'fp8conf.parallel' has no attribute {name!r}")

"""The runner an engine config needs: `PoolingModelRunner` for a pooling task, else `ModelRunner`."""

from __future__ import annotations

from aserve.config import AserveConfig
from aserve.distributed.context import SINGLE, ParallelContext


def make_runner(config: AserveConfig, parallel: ParallelContext = SINGLE):
    """An unstarted runner (load_model -> initialize_kv_cache -> capture_graphs -> execute)."""
    if config.is_pooling:
        from aserve.runner.pooling_runner import PoolingModelRunner

        return PoolingModelRunner(config, parallel=parallel)
    from aserve.runner.model_runner import ModelRunner

    return ModelRunner(config, parallel=parallel)

"""Fixtures of the handler's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def metrics_cache():
    """TorchServe's backend metrics cache from its own default metrics.yaml, initialised: what
    `EngineMetrics` writes its lines through (skipped where TorchServe is not installed)."""
    ts_metrics = pytest.importorskip("ts.metrics.metric_cache_yaml_impl")
    ts_async = pytest.importorskip("ts.async_service")
    cache = ts_metrics.MetricsCacheYamlImpl(
        config_file_path=ts_async.__file__.replace("async_service.py", "configs/metrics.yaml")
    )
    cache.initialize_cache()
    return cache

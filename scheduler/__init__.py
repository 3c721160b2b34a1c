"""orcaserve engine: ORCA iteration-level scheduling over a paged KV cache."""

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.model.loader import default_model_path
from orcaserve.scheduler.sampling_params import SamplingParams
from orcaserve.scheduler.serving.engine_loop import EngineLoop
from orcaserve.scheduler.serving.request_stream import RequestError, RequestStream

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineLoop",
    "RequestError",
    "RequestOutput",
    "RequestStream",
    "RequestTimes",
    "SamplingParams",
    "default_model_path",
]

"""orcaserve engine: ORCA iteration-level scheduling over a paged KV cache."""

from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.outputs import RequestOutput, RequestTimes
from orcaserve.scheduler.engine import Engine
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import EngineError, InternalError, InvalidRequest, Overloaded, ShuttingDown, TimedOut
from orcaserve.scheduler.model.loader import default_model_path
from orcaserve.scheduler.sampling_params import RequestOutputKind, SamplingParams
from orcaserve.scheduler.serving.engine_loop import EngineLoop
from orcaserve.scheduler.serving.request_stream import RequestStream

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineLoop",
    "EngineRequest",
    "InternalError",
    "InvalidRequest",
    "Overloaded",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "RequestTimes",
    "SamplingParams",
    "ShuttingDown",
    "TimedOut",
    "default_model_path",
]

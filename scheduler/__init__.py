"""orcaserve engine: ORCA iteration-level scheduling over a paged KV cache."""

from .config import EngineConfig
from .engine import Engine
from .engine_loop import EngineLoop
from .loader import default_model_path
from .outputs import RequestOutput, RequestTimes
from .request_stream import RequestError, RequestStream
from .sampling_params import SamplingParams

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

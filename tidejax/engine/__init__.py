"""Generation: the engine (jitted steps over caches and expert state), scheduler, sampling."""

from tidejax.engine.engine import Engine, load
from tidejax.engine.sampling import SamplingParams
from tidejax.engine.scheduler import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent

__all__ = ["DoneEvent", "Engine", "ErrorEvent", "GenerationRequest", "SamplingParams", "TokenEvent",
           "load"]

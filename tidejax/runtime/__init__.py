"""Generation: the Engine facade, the scheduler that owns the DecodeState, the jitted steps, sampling."""

from tidejax.runtime.engine import Engine, load
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.api import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent

__all__ = ["DoneEvent", "Engine", "ErrorEvent", "GenerationRequest", "SamplingParams", "TokenEvent",
           "load"]

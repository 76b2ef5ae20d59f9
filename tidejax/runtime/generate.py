"""`Engine.generate` and `tidejax.generate`: requests through the same scheduler the server uses."""

from __future__ import annotations

from tidejax.errors import EngineError, RequestError
from tidejax.text.detok import IncrementalDetokenizer, StopMatcher
from tidejax.runtime.sampling import SamplingParams
from tidejax.runtime.scheduler import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent


def _is_chat(item) -> bool:
    return isinstance(item, list) and all(isinstance(m, dict) for m in item) and bool(item)


def generate(engine, prompts, *, max_new_tokens: int, sampling: SamplingParams,
             stop: tuple[str, ...] = (), on_text=None):
    if engine.scheduler.thread is not None:
        raise RuntimeError("generate() while the scheduler thread serves: use the server API")
    if sampling.logprobs is not None:
        raise RequestError("generate() returns text: ask the server for logprobs", "logprobs")
    single = isinstance(prompts, str) or _is_chat(prompts)
    items = [prompts] if single else list(prompts)
    outputs = [""] * len(items)
    done = [False] * len(items)
    errors: list[str] = []
    handles = []
    for i, item in enumerate(items):
        ids = engine.tokenizer.encode_chat(item) if _is_chat(item) else engine.tokenizer.encode(item)
        detok, stops = IncrementalDetokenizer(engine.tokenizer), StopMatcher(stop)

        def on_event(event, i=i, detok=detok, stops=stops):
            if isinstance(event, TokenEvent):
                text = stops.feed(detok.push(event.token_id))
            elif isinstance(event, DoneEvent):
                text, done[i] = stops.feed(detok.flush()) + stops.flush(), True
            else:
                assert isinstance(event, ErrorEvent)
                text, done[i] = "", True
                errors.append(event.message)
            if text:
                outputs[i] += text
                if on_text:
                    on_text(i, text)
            if stops.stopped:
                handles[i].cancel()

        handles.append(engine.scheduler.submit(GenerationRequest(ids, max_new_tokens, sampling),
                                               on_event))
    engine.scheduler.run_until_idle()
    if errors:
        raise EngineError(errors[0])
    return outputs[0] if single else outputs

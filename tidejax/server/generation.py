"""What every generating route shares: the served model (the engine's info and the server's
limits), the prompt and token budget checks, and one request's run from token events to text
with stop strings applied, its log line and its metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid

from tidejax.text.chat_template import TemplateRenderError
from tidejax.text.detok import IncrementalDetokenizer, StopMatcher
from tidejax.server.client import DoneEvent, EngineClient, EngineInfo, GenerationRequest, TokenEvent
from tidejax.server.errors import APIError
from tidejax.server.metrics import Metrics
from tidejax.server.schemas import ChatInput, GenerationOptions
from tidejax.text.toolcalls import OutputParser, starts_in_reasoning

log = logging.getLogger("tidejax.server")


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    info: EngineInfo
    max_tokens_limit: int  # the server's cap on one request's generated tokens
    keep_special: frozenset[int]  # special tokens the output parsers read (tool calls, thinking)

    @staticmethod
    def of(info: EngineInfo, max_tokens_limit: int) -> "ServedModel":
        if info.chat_template is None:
            log.warning("%s has no chat template; /v1/chat/completions and /v1/messages are "
                        "unavailable", info.name)
        keep = frozenset(i for i, text in info.tokenizer.special_tokens.items()
                         if any(word in text.lower() for word in ("tool", "think")))
        return ServedModel(info, max_tokens_limit, keep)

    @property
    def name(self) -> str:
        return self.info.name

    def chat_prompt(self, chat: ChatInput) -> tuple[list[int], bool]:
        """Token ids of the rendered conversation, and whether the output starts inside a
        `<think>` block (the template opened it)."""
        tool_format = self.info.tool_format
        if self.info.chat_template is None:
            raise APIError(400, f"model {self.name!r} has no chat template: use /v1/completions")
        messages = chat.messages
        if tool_format is not None and tool_format.arguments_as_dict:
            messages = [_arguments_as_dicts(m, i) for i, m in enumerate(messages)]
        try:
            ids, text = self.info.tokenizer.chat_prompt(messages, tools=chat.tools,
                                                        **chat.template_kwargs)
        except TemplateRenderError as e:
            raise APIError(400, str(e), param="messages") from None
        return ids, starts_in_reasoning(text)

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.info.tokenizer.encode(prompt)
        vocab = self.info.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"'prompt' has token id {bad}, outside the vocabulary "
                                f"[0, {vocab})", param="prompt")
        return prompt

    def budget(self, prompt_len: int, options: GenerationOptions) -> int:
        """The number of tokens this request may generate; 400 when the prompt or the asked
        max_tokens does not fit."""
        max_tokens, param = options.max_tokens, options.max_tokens_param
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = self.info.max_context - prompt_len - 1
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                f"{self.info.max_context} tokens", code="context_length_exceeded")
        if max_tokens is None:
            return min(room, self.max_tokens_limit)
        if max_tokens > self.max_tokens_limit:
            raise APIError(400, f"'{param}' = {max_tokens} is above this server's limit of "
                                f"{self.max_tokens_limit}", param=param)
        if max_tokens > room:
            raise APIError(400, f"'{param}' = {max_tokens} does not fit: the prompt has "
                                f"{prompt_len} tokens and the context is {self.info.max_context}",
                           param=param, code="context_length_exceeded")
        return max_tokens


def _arguments_as_dicts(message: dict, i: int) -> dict:
    """Templates that iterate a tool call's arguments want a mapping, not the JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise APIError(400, f"'{param}' should be a JSON object", param=param)
        calls.append({**call, "function": {**call["function"], "arguments": args}})
    return {**message, "tool_calls": calls}


class Generation:
    """One request on the engine. `async for text in gen.texts()` yields detokenized text with
    stop strings cut; afterwards `finish_reason`, `prompt_tokens`, `completion_tokens` and
    `engine_stats` are set. Leaving the loop early (client gone) cancels the request."""

    def __init__(self, client: EngineClient, metrics: Metrics, model: ServedModel,
                 request_id: str, prompt_ids: list[int], options: GenerationOptions,
                 max_new_tokens: int):
        self.client, self.metrics, self.model = client, metrics, model
        self.id = request_id
        self.request = GenerationRequest(prompt_ids, max_new_tokens, options.sampling,
                                         ignore_eos=options.ignore_eos)
        self.stop = options.stop
        self.finish_reason = "cancelled"
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.stats: dict = {}
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    @property
    def engine_stats(self) -> dict:
        return {k: self.stats.get(k, 0.0)
                for k in ("prefill_tps", "decode_tps", "cold_share", "cpu_picks",
                          "approx_weight_share")}

    async def texts(self):
        detok = IncrementalDetokenizer(self.model.info.tokenizer, keep=self.model.keep_special)
        stops = StopMatcher(self.stop)
        started = time.perf_counter()
        raw, released = "", 0  # detokenized text, and how much of it went out
        try:
            stream = self.client.submit(self.request)
        except ValueError as e:  # the engine refuses a request it cannot run
            raise APIError(400, str(e)) from None

        def release(new: str) -> str:
            nonlocal raw, released
            raw += new
            text = stops.feed(new)
            released += len(text)
            if stops.stopped:
                stream.cancel()
                self.stop_string = next(s for s in self.stop if raw.startswith(s, released))
            return text

        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    self.completion_tokens += 1
                    if not stops.stopped:  # else: tokens made before the cancel took effect
                        if text := release(detok.push(event.token_id)):
                            yield text
                elif isinstance(event, DoneEvent):
                    tail = "" if stops.stopped else release(detok.flush())
                    if tail := tail + stops.flush():
                        yield tail
                    self.finish_reason = "stop" if stops.stopped else event.finish_reason
                    self.stats = event.stats
                    self.completion_tokens = event.stats.get("completion_tokens",
                                                             self.completion_tokens)
                else:
                    self.finish_reason = "error"
                    log.error("%s: engine error: %s", self.id, event.message)
                    raise APIError(500, "the engine failed on this request (the server's log "
                                        "has the details)")
        finally:
            stream.cancel()  # a no-op when the stream has ended
            self._record(time.perf_counter() - started)

    def _record(self, seconds: float) -> None:
        s = self.engine_stats
        log.info("%s prompt=%d generated=%d prefill=%.1f tok/s decode=%.1f tok/s cold=%.3f "
                 "finish=%s %.0f ms", self.id, self.prompt_tokens, self.completion_tokens,
                 s["prefill_tps"], s["decode_tps"], s["cold_share"], self.finish_reason,
                 seconds * 1e3)
        self.metrics.record_generation(self.prompt_tokens, self.completion_tokens,
                                       self.finish_reason, self.stats)


async def output_pieces(gen: Generation, parser: OutputParser):
    """The generation's text split by `parser` into ("reasoning" | "content", text) pieces as
    they come; afterwards `parser.tool_calls` holds the tool calls. Use under
    contextlib.aclosing so that a handler that stops early cancels the request."""
    async with contextlib.aclosing(gen.texts()) as texts:
        async for text in texts:
            for piece in parser.feed(text):
                yield piece
    for piece in parser.finish():
        yield piece

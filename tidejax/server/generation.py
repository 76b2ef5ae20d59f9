"""What every generating route shares: the served model (the engine's info and the server's
limits), the prompt, token budget and thinking checks, one choice's run from token events to
text with stop strings applied (and its logprobs), its log line and its metrics, and the choices
of one request merged as they come.

A request's reasoning field (OpenAI `reasoning_effort`, Anthropic `thinking`) is mapped onto the
chat template's own thinking control, the variables it reads: `reasoning_effort` takes the
effort as given (one of the model format's `efforts` where it names them: gpt-oss's low, medium,
high); a switch (`enable_thinking`, `thinking`) is set on, or off for the efforts
"none" and "minimal" and for Anthropic's "disabled". A template with neither gets a 400 naming
the field. Anthropic's `budget_tokens` becomes the sampler's thinking budget: after that many
tokens without a `</think>`, the next token is `</think>` (runtime/sampling.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

from tidejax.errors import EngineError, RequestError
from tidejax.runtime.api import DoneEvent, EngineClient, EngineInfo, GenerationRequest, TokenEvent
from tidejax.text.chat_template import TemplateRenderError
from tidejax.text.detok import IncrementalDetokenizer, StopMatcher
from tidejax.server.errors import APIError
from tidejax.server.metrics import Metrics
from tidejax.server.schemas import ChatInput, GenerationOptions, Thinking, load_json
from tidejax.text.toolcalls import THINK_CLOSE, OutputParser, starts_in_reasoning

log = logging.getLogger("tidejax.server")

EFFORT_VARIABLE = "reasoning_effort"  # a template variable taking OpenAI's effort as is
THINKING_SWITCHES = ("enable_thinking", "thinking")  # template booleans that turn reasoning on


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
        format_tokens = info.tool_format.tokens if info.tool_format else ()
        keep = frozenset(i for i, text in info.tokenizer.special_tokens.items()
                         if any(word in text.lower() for word in ("tool", "think"))
                         or text in format_tokens)
        return ServedModel(info, max_tokens_limit, keep)

    @property
    def name(self) -> str:
        return self.info.name

    def chat_prompt(self, chat: ChatInput) -> tuple[list[int], bool]:
        """Token ids of the rendered conversation, and whether the output starts inside a
        `<think>` block (the template opened it)."""
        tool_format = self.info.tool_format
        if self.info.chat_template is None:
            raise RequestError(f"model {self.name!r} has no chat template: use /v1/completions")
        messages = chat.messages
        if tool_format is not None:
            messages = [_as_template_reads(m, i, tool_format) for i, m in enumerate(messages)]
        kwargs = {**chat.template_kwargs, **self._thinking_kwargs(chat)}
        try:
            ids, text = self.info.tokenizer.chat_prompt(messages, tools=chat.tools,
                                                        continue_final=chat.continue_final,
                                                        **kwargs)
        except TemplateRenderError as e:
            raise RequestError(str(e), field="messages") from None
        return ids, starts_in_reasoning(text)

    def _thinking_kwargs(self, chat: ChatInput) -> dict:
        """The template kwargs that carry the request's reasoning field (the module docstring
        says how); a 400 naming the field where the template has no thinking control."""
        thinking = chat.thinking
        if thinking is None:
            return {}
        variables = self.info.chat_template.variables
        if thinking.effort is not None and EFFORT_VARIABLE in variables:
            efforts = self.info.tool_format.efforts if self.info.tool_format else None
            if efforts is not None and thinking.effort not in efforts:
                raise RequestError(f"'reasoning_effort' = {thinking.effort!r}: the chat template "
                                   f"of {self.name!r} takes {', '.join(efforts)}",
                                   field="reasoning_effort")
            kwargs = {EFFORT_VARIABLE: thinking.effort}
        else:
            kwargs = {name: thinking.enabled for name in THINKING_SWITCHES if name in variables}
        if not kwargs:
            controls = ", ".join((EFFORT_VARIABLE, *THINKING_SWITCHES))
            raise RequestError(f"'{thinking.param}': the chat template of {self.name!r} has no "
                               f"thinking control (it reads none of {controls})",
                               field=thinking.param)
        for name in kwargs:
            if name in chat.template_kwargs:
                raise RequestError(f"'{thinking.param}' and 'chat_template_kwargs.{name}' both "
                                   "set the thinking control: send one", field=thinking.param)
        return kwargs

    def options(self, options: GenerationOptions, thinking: Thinking | None) -> GenerationOptions:
        """The options with the thinking budget as the sampler's, every token id checked against
        the vocabulary."""
        sampling = options.sampling
        if thinking is not None and thinking.budget:
            end = self.info.tokenizer.token_id(THINK_CLOSE)
            if end is None:
                raise RequestError(f"'thinking.budget_tokens': {self.name!r} has no single "
                                   f"{THINK_CLOSE} token to end its reasoning with",
                                   field="thinking.budget_tokens")
            sampling = dataclasses.replace(sampling, thinking_budget=thinking.budget,
                                           thinking_end=end)
        sampling.check_vocab(self.info.tokenizer.vocab_size)
        return dataclasses.replace(options, sampling=sampling)

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.info.tokenizer.encode(prompt)
        vocab = self.info.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"'prompt' has token id {bad}, outside the vocabulary "
                               f"[0, {vocab})", field="prompt")
        return prompt

    def budget(self, prompt_len: int, options: GenerationOptions) -> int:
        """The number of tokens this request may generate; 400 when the prompt or the asked
        max_tokens does not fit."""
        max_tokens, param = options.max_tokens, options.max_tokens_param
        if prompt_len == 0:
            raise RequestError("the prompt is empty", field="prompt")
        room = self.info.max_context - prompt_len - 1
        if room < 1:
            raise RequestError(f"the prompt has {prompt_len} tokens; this model's context is "
                               f"{self.info.max_context} tokens", code="context_length_exceeded")
        if max_tokens is None:
            return min(room, self.max_tokens_limit)
        if max_tokens > self.max_tokens_limit:
            raise RequestError(f"'{param}' = {max_tokens} is above this server's limit of "
                               f"{self.max_tokens_limit}", field=param)
        if max_tokens > room:
            raise RequestError(f"'{param}' = {max_tokens} does not fit: the prompt has "
                               f"{prompt_len} tokens and the context is {self.info.max_context}",
                               field=param, code="context_length_exceeded")
        return max_tokens


def _as_template_reads(message: dict, i: int, tool_format) -> dict:
    """Message `i` as the model's template reads it: a tool call's arguments as a mapping where
    it iterates them or writes them as JSON itself, the reasoning under the field it reads."""
    if tool_format.arguments_as_dict:
        message = _arguments_as_dicts(message, i)
    key = tool_format.reasoning_key
    if "reasoning_content" in message and key != "reasoning_content":
        message = {(key if k == "reasoning_content" else k): v for k, v in message.items()}
    return message


def _arguments_as_dicts(message: dict, i: int) -> dict:
    """Templates that iterate a tool call's arguments want a mapping, not the JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        param = f"messages[{i}].tool_calls[{j}].function.arguments"
        args = load_json(call["function"]["arguments"] or "{}", param)
        if not isinstance(args, dict):
            raise RequestError(f"'{param}' should be a JSON object", field=param)
        calls.append({**call, "function": {**call["function"], "arguments": args}})
    return {**message, "tool_calls": calls}


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and its request's top alternatives (token id,
    logprob), best first; `offset`: characters of the choice's text before this token's."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int


class Generation:
    """One choice of a request on the engine. `async for text, logprobs in gen.texts()` yields
    detokenized text with stop strings cut, and the TokenLogprobs of the tokens since the last
    text (empty unless asked for); afterwards `finish_reason`, `prompt_tokens`,
    `completion_tokens` and `engine_stats` are set. Leaving the loop early (client gone) cancels
    the request, as does its `deadline` (the event loop's time; None: none) passing while it
    waits on the engine: a 504, finish reason "timeout". Choice `index` > 0 of a seeded request
    samples with seed + index."""

    def __init__(self, client: EngineClient, metrics: Metrics, model: ServedModel,
                 request_id: str, prompt_ids: list[int], options: GenerationOptions,
                 max_new_tokens: int, index: int = 0, deadline: float | None = None):
        self.client, self.metrics, self.model = client, metrics, model
        self.id, self.index, self.deadline = request_id, index, deadline
        sampling = options.sampling
        if index and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) & 0x7FFFFFFF)
        self.request = GenerationRequest(prompt_ids, max_new_tokens, sampling,
                                         ignore_eos=options.ignore_eos)
        self.stop = options.stop
        self.finish_reason = "cancelled"
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.stats: dict = {}
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine found in its prompt cache (not prefilled), once done."""
        return int(self.stats.get("cached_tokens", 0))

    @property
    def engine_stats(self) -> dict:
        """x_engine_stats: the speeds and residency's shares, and speculative decoding's drafted
        and accepted tokens and acceptance where it is on."""
        return {k: self.stats.get(k, 0.0)
                for k in ("prefill_tps", "decode_tps", "cold_share", "cpu_picks",
                          "approx_weight_share")} | {
            k: self.stats[k] for k in ("drafted_tokens", "accepted_tokens", "acceptance")
            if k in self.stats}

    async def texts(self):
        detok = IncrementalDetokenizer(self.model.info.tokenizer, keep=self.model.keep_special)
        stops = StopMatcher(self.stop)
        started = time.perf_counter()
        raw, released = "", 0  # detokenized text, and how much of it went out
        logprobs: list[TokenLogprob] = []  # since the last text went out

        def taken() -> list[TokenLogprob]:
            out = logprobs[:]
            logprobs.clear()
            return out

        stream = self.client.submit(self.request)  # a RequestError when the engine refuses it

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
            while (event := await self._next(stream)) is not None:
                if isinstance(event, TokenEvent):
                    self.completion_tokens += 1
                    if not stops.stopped:  # else: tokens made before the cancel took effect
                        if event.logprob is not None:
                            logprobs.append(TokenLogprob(event.token_id, event.logprob,
                                                         event.top, len(raw)))
                        if text := release(detok.push(event.token_id)):
                            yield text, taken()
                elif isinstance(event, DoneEvent):
                    tail = "" if stops.stopped else release(detok.flush())
                    if (tail := tail + stops.flush()) or logprobs:
                        yield tail, taken()
                    self.finish_reason = "stop" if stops.stopped else event.finish_reason
                    self.stats = event.stats
                    self.completion_tokens = event.stats.get("completion_tokens",
                                                             self.completion_tokens)
                else:
                    self.finish_reason = "error"
                    raise EngineError(f"{self.id}: {event.message}")
        finally:
            stream.cancel()  # a no-op when the stream has ended
            self._record(time.perf_counter() - started)

    async def _next(self, stream):
        """The stream's next event (None at its end), or a 504 once the deadline has passed
        (the caller's `finally` cancels the request, which frees its lane and pages)."""
        try:
            async with asyncio.timeout_at(self.deadline):
                return await anext(stream, None)
        except TimeoutError:
            self.finish_reason = "timeout"
            self.metrics.timeouts += 1
            raise APIError(504, "the request ran past its deadline (server.request_timeout_s) "
                                "and was cancelled", code="timeout") from None

    def _record(self, seconds: float) -> None:
        s = self.engine_stats
        log.info("%s prompt=%d generated=%d prefill=%.1f tok/s decode=%.1f tok/s cold=%.3f "
                 "finish=%s %.0f ms", self.id, self.prompt_tokens, self.completion_tokens,
                 s["prefill_tps"], s["decode_tps"], s["cold_share"], self.finish_reason,
                 seconds * 1e3)
        self.metrics.record_generation(self.prompt_tokens, self.completion_tokens,
                                       self.finish_reason, self.stats)


async def output_pieces(gen: Generation, parser: OutputParser):
    """The generation's text split by `parser` into ("reasoning" | "content", text, logprobs)
    pieces as they come, a text's TokenLogprobs with its first piece (with an empty content
    piece where the text gave none); afterwards `parser.tool_calls` holds the tool calls. Use
    under contextlib.aclosing so that a handler that stops early cancels the request."""
    async with contextlib.aclosing(gen.texts()) as texts:
        async for text, logprobs in texts:
            for kind, piece in parser.feed(text):
                yield kind, piece, logprobs
                logprobs = []
            if logprobs:
                yield "content", "", logprobs
    for kind, piece in parser.finish():
        yield kind, piece, []


async def merged(sources: list):
    """(i, item) from the async generators `sources` as their items come (the choices of one
    request); closing it early closes them all (their requests cancelled). An exception in one
    ends the whole."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, source) -> None:
        try:
            async for item in source:
                await queue.put((i, item))
            await queue.put((i, end))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, source)) for i, source in enumerate(sources)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await source.aclose()

"""A tiny checkpoint for the server tests, a live server process on a free loopback port, and
the HTTP app in this process over any EngineClient (`serve_app`, `ScriptedClient`).

The checkpoint is transformers' own DeepseekV3ForCausalLM with a tiny random config, plus a
byte-level BPE tokenizer whose chat template speaks the Hermes tool-call format. So that a tool
call can make a real round trip, the weights are edited so that the model writes one fixed call:
four "chain" tokens own four residual dimensions that no attention or MLP output writes to, and
the unembedding maps each chain token to its successor through those dimensions alone
(<|tool_hint|> -> <tool_call> -> CALL_JSON -> </tool_call> -> <|eos|>). The template ends the
prompt with <|tool_hint|> only when tools are offered and the user spoke last, so every other
prompt continues as a plain random model (whose text never reaches a chain token or <|eos|>:
their logits are 0 off the chain while some of the random ones are positive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch
from aiohttp import web

from tidejax.errors import RequestError
from tidejax.runtime.api import DoneEvent, EngineInfo, EngineStats, GenerationRequest, TokenEvent
from tidejax.server.app import Server, build_app
from tests.support.tiny_models import TEXT, deepseek_v3_config

REPO = Path(__file__).resolve().parents[2]
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SPECIAL = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
           "<|tool_hint|>"]
PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", CALL_JSON]
CHAIN = ["<|tool_hint|>", "<tool_call>", CALL_JSON, "</tool_call>", "<|eos|>"]

CHAT_TEMPLATE = """{{ bos_token }}
{% if tools %}<|system|>You may call: {{ tools | tojson }}
{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' %}<|assistant|>{{ m.content }}
{% for c in m.tool_calls or [] %}<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|eos|>
{% else %}<|{{ m.role }}|>{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% if tools and messages[-1].role == 'user' %}<|tool_hint|>{% endif %}
{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}
{% endif %}"""


def write_tokenizer(path: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in PLAIN_ADDED])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))
    return {t: tok.token_to_id(t) for t in SPECIAL + PLAIN_ADDED}


def write_chat_model(path: Path, seed: int = 0) -> Path:
    """The tiny checkpoint described above, float32, in `path`."""
    from transformers import DeepseekV3ForCausalLM
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    vocab = max(ids.values()) + 1
    config = deepseek_v3_config(vocab_size=vocab, num_hidden_layers=2, first_k_dense_replace=1,
                                q_lora_rank=None, n_group=1, topk_group=1,
                                max_position_embeddings=1024,
                                bos_token_id=ids["<|bos|>"], eos_token_id=ids["<|eos|>"])
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    write_chain(model, [ids[t] for t in CHAIN])
    model.save_pretrained(path)
    return path


def write_chain(model, chain: list[int]) -> None:
    """Edits a transformers causal LM of the DeepSeek-V3 shape (a residual stream written by
    attention's o_proj and the MLPs' down_proj) so that greedy decoding maps each token of
    `chain` to the next (the module docstring says how); the model never writes chain[0]
    itself."""
    hidden = model.config.hidden_size
    reserved = torch.tensor(range(hidden - len(chain) + 1, hidden))  # a dimension per source
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("o_proj.weight", "o_proj.bias")) or "down_proj" in name:
                # nothing but the embedding writes the reserved dimensions of the residual
                w.index_fill_(_residual_axis(name, w, hidden), reserved, 0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.normal_(0, 1.0)  # well separated logits: greedy choices robust to rounding
        embed[:, reserved] = 0
        head[:, reserved] = 0
        head[chain[0]] = 0  # only the template writes the chain's first token
        for dim, (source, target) in zip(reserved, zip(chain, chain[1:])):
            embed[source, dim] = 1.0
            head[target] = 0
            head[target, dim] = 40.0


def _residual_axis(name: str, w, hidden: int) -> int:
    """The axis along which a parameter writes the residual stream: a bias's, a Linear weight's
    first ([out, in]), fused experts' hidden one ([E, D, I]; gpt-oss's [E, I, D])."""
    if name.endswith("bias"):
        return w.dim() - 1
    if w.dim() == 2:
        return 0
    [axis] = [i for i in (1, 2) if w.shape[i] == hidden]
    return axis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_profile(path: Path, model_dir: Path, **tables) -> Path:
    """A profile TOML for `model_dir`; `tables` = {"engine": {"lanes": 4}, ...}."""
    tables = {"model": {"path": str(model_dir), "served_name": "tiny"}, **tables}
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_coordinator() -> str:
    """A loopback host:port whose next port (the channel's) is free too."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return f"127.0.0.1:{port}"
    raise RuntimeError("no two free neighbouring ports")


def start_peer(profile: Path, *sets: str) -> subprocess.Popen:
    """Process 1 of the profile's pair, `sets` on top; its log beside the profile."""
    args = [a for s in sets for a in ("--set", s)]
    log = open(profile.with_name(profile.stem + "-peer.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "tidejax.server", "--profile", str(profile),
                             "--set", "distributed.process_id=1", *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def run_pair(profile: Path, script: str, *args: str, timeout: float = 600) -> dict:
    """Process 1 of the profile's pair following (start_peer), `script` as process 0 (python -c,
    given the profile and `args`); the JSON of its last output line once both stopped cleanly."""
    peer = start_peer(profile)
    try:
        run = subprocess.run([sys.executable, "-c", script, str(profile), *args],
                             capture_output=True, text=True, cwd=REPO, timeout=timeout,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert run.returncode == 0, run.stderr[-4000:]
        assert peer.wait(timeout=60) == 0
    finally:
        peer.kill()
    return json.loads(run.stdout.strip().splitlines()[-1])


def launch_server(profile: Path, *extra_args: str, timeout: float = 180.0,
                  env: dict | None = None, warmup: bool = False) -> tuple[subprocess.Popen, str]:
    """Starts `python -m tidejax.server --profile PROFILE` on a free port, its log appended to
    PROFILE.log, and waits until /health says ready: (the process, the base URL). Shows the log
    when it exits or is not ready in time. Without `warmup` the server starts with
    engine.warmup = false: it compiles only the step shapes the test's requests meet."""
    port = free_port()
    log_path = profile.with_suffix(".log")
    with open(log_path, "a") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidejax.server", "--profile", str(profile),
             "--host", "127.0.0.1", "--port", str(port), *extra_args,
             *(() if warmup else ("--set", "engine.warmup=false"))],
            stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout} s:\n{log_path.read_text()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.load(r)["status"] == "ready":
                        return proc, url
            time.sleep(0.2)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 60 s (a loaded CI machine has taken over 20 s to write a
    profiler trace and the history on the way out); the exit code."""
    proc.terminate()
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextlib.contextmanager
def live_server(profile: Path, *extra_args: str, timeout: float = 180.0, env: dict | None = None,
                warmup: bool = False):
    """`launch_server` for a `with` block: yields the base URL, stops the process after."""
    proc, url = launch_server(profile, *extra_args, timeout=timeout, env=env, warmup=warmup)
    try:
        yield url
    finally:
        stop_server(proc)


def server_log(profile: Path) -> str:
    return profile.with_suffix(".log").read_text()


@contextlib.contextmanager
def serve_app(server: Server):
    """The real app over `server` on a free loopback port, its event loop on a thread; yields the
    base URL."""
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(server))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class ScriptedStream:
    """A RequestStream of fixed tokens then "length"; cancel() ends it with "cancelled"."""

    def __init__(self, tokens: list[int]):
        self.events = [TokenEvent(t) for t in tokens] + [DoneEvent("length", {})]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self) -> None:
        if self.events:
            self.events = [DoneEvent("cancelled", {})]


class ScriptedClient:
    """An EngineClient with no engine: every request is answered with the first max_new_tokens
    tokens of `reply`; a prompt of more than `refuse_over` tokens is refused. `requests` holds
    what the server submitted."""

    def __init__(self, info: EngineInfo, reply: str, refuse_over: int):
        self.info = info
        self.reply = info.tokenizer.encode(reply, add_special_tokens=False)
        self.refuse_over = refuse_over
        self.requests: list[GenerationRequest] = []

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def submit(self, request: GenerationRequest) -> ScriptedStream:
        if len(request.prompt_ids) > self.refuse_over:
            raise RequestError(f"the prompt has {len(request.prompt_ids)} tokens, too many",
                               "prompt")
        self.requests.append(request)
        return ScriptedStream(self.reply[:request.max_new_tokens])

    def stats(self) -> EngineStats:
        return EngineStats(queued=1, active=2, residency={"misses": 7, "geometry": "per_layer"})

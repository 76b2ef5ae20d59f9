"""Process 0's calls over the decode state, replayed by its peers (tensor parallelism).

Every process holds its shards of one DecodeState and must run the same jitted calls over it,
with the same host inputs, in the same order (each call's collectives pair the processes).
Process 0's Scheduler decides everything: admissions, prompt chunks, sampling keys, residency's
swap batches and drains. Before each call over the state it sends the call's host inputs
(`Replicas.send`); each peer's `follow` loop receives them and makes the same call through a
Scheduler of its own that never schedules. A message is (kind, args):

    ("boot", slot_rows)            first: process 0's boot map, which a peer takes where its own
                                   differs (its residency history is not process 0's)
    ("step", StepInputs)           Scheduler.dispatch; a decoding lane's `previous` tokens are
                                   named ("last": the previous step's output, "host": none),
                                   as each process holds its own copy of them, and the family's
                                   step tables left out (each process has its own)
    ("score", ScoreInputs)         Scheduler.score_with (on the host, the step tables left out)
    ("set_lane", lane, params)     Scheduler.set_sampling
    ("read", pages, lane, copy)    Scheduler.read_sequence: each process keeps its own copy
                                   (its shards of KV pages split by heads), a peer under the
                                   number `copy` process 0 gives each read
    ("write", pages, lane, copy)   Scheduler.write_sequence of the peer's copy `copy`
    ("forget", copy)               a preempted request cancelled: its copies are dropped
    ("experts", SwapBatch)         a batch residency applies between steps (drain, reseed)
    ("stop",)

Residency is decided once, on process 0: the peers' own Residency only boots (the same boot
map) and never plans. The counters are replicated device values (the
MoE layer counts the same picks on every device), so process 0 reads them whole.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from tidejax.config import EngineConfig
from tidejax.residency.swap import apply_now
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.steps import ScoreInputs, StepInputs

log = logging.getLogger("tidejax")


class Replicas:
    """Process 0's end, held by its Scheduler: each call's host inputs to every peer."""

    def __init__(self, channel, model: LoadedModel):
        self.channel = channel
        self.model = model
        self.last_tokens = None  # the tokens of the step dispatched last (on the device)
        self.reads = 0  # read_sequence calls numbered so far
        model.residency.on_apply = lambda batch: self.send("experts", batch)
        self.send("boot", model.residency.slot_rows)

    def send(self, kind: str, *args) -> None:
        self.channel.send((kind, *args))

    def send_read(self, pages, lane: int) -> int:
        """Sends a read_sequence; returns the number under which the peers keep their copies."""
        self.reads += 1
        self.send("read", pages, lane, self.reads)
        return self.reads

    def send_step(self, inputs: StepInputs) -> None:
        """The step's inputs, its `previous` tokens named (see above)."""
        inputs = self._without_tables(inputs)
        decode = inputs.decode
        if decode is not None:
            if decode.previous is self.model.host_only:
                named = "host"
            elif decode.previous is self.last_tokens:
                named = "last"
            else:
                raise ValueError("a step's previous tokens must be the last step's output")
            inputs = dataclasses.replace(inputs, decode=dataclasses.replace(decode, previous=named))
        if inputs.replay is not None:
            raise ValueError("routing replay is not served across processes")
        self.send("step", inputs)

    def send_score(self, inputs: ScoreInputs) -> None:
        self.send("score", jax.device_get(self._without_tables(inputs)))  # its scratch cache

    def _without_tables(self, inputs):
        if inputs.tables is not self.model.step_tables:
            raise ValueError("a step's tables must be the model's")
        return dataclasses.replace(inputs, tables=None)

    def stop(self) -> None:
        self.model.residency.on_apply = None
        self.send("stop")
        self.channel.close()


def follow(config: EngineConfig, channel) -> None:
    """A peer's life: load the same model, then replay process 0's calls until it stops."""
    from tidejax.runtime.engine import use_compile_cache  # they import this module
    from tidejax.runtime.scheduler import Scheduler

    if config.engine.compile_cache:
        use_compile_cache(config.engine.compile_cache)
    model = LoadedModel(config)
    scheduler = Scheduler(model)
    last_tokens = None
    copies = {}  # this process's saved sequences, by process 0's number for each read
    log.info("process %d follows process 0", config.distributed.process_id)
    while True:
        kind, *args = channel.receive()
        if kind == "stop":
            break
        if kind == "boot":
            (slot_rows,) = args
            if not np.array_equal(slot_rows, model.residency.slot_rows):
                model.residency.slot_rows[:] = slot_rows  # process 0's boot map (its history)
                scheduler.state = model.rebuilt_state(scheduler.state)
        elif kind == "step":
            (inputs,) = args
            if inputs.decode is not None:
                previous = model.host_only if inputs.decode.previous == "host" else last_tokens
                inputs = dataclasses.replace(
                    inputs, decode=dataclasses.replace(inputs.decode, previous=previous))
            sampled, _ = scheduler.dispatch(dataclasses.replace(inputs, tables=model.step_tables))
            last_tokens = sampled.tokens
        elif kind == "score":
            (inputs,) = args
            scheduler.score_with(dataclasses.replace(inputs, tables=model.step_tables))
        elif kind == "set_lane":
            scheduler.set_sampling(*args)
        elif kind == "read":
            pages, lane, copy = args
            copies[copy] = scheduler.read_sequence(pages, lane)
        elif kind == "write":
            pages, lane, copy = args
            scheduler.write_sequence(pages, lane, copies.pop(copy))
        elif kind == "forget":
            copies.pop(args[0], None)
        elif kind == "experts":
            (batch,) = args
            scheduler.update_experts(lambda experts: apply_now(experts, batch)[0])
        else:
            raise ValueError(f"process 0 sent an unknown message {kind!r}")
    channel.close()
    log.info("process %d: process 0 stopped", config.distributed.process_id)

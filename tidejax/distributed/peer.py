"""A peer of a tensor-parallel engine (process_id > 0): a runner fed process 0's plans.

It loads the same model as process 0, then carries out the messages process 0's Runner sends
(tidejax.runtime.runner): ("boot", slot_rows, host map), then ("plan", StepPlan) for every
plan, in order, until ("stop",); ("ping",) between them only tells process 0 the connection
holds. It decides nothing: admission, chunks, sampling keys and residency are process 0's, and
the peer's results (tokens, counters) are the same replicated values process 0 reads. Its
prompt cache tiers are its own (its shards of each page): it reports their counts to process 0
(after a boot, a ping, and a plan that spilled or restored pages). So is its disk tier of experts
(its shards of each row), whose host cache follows process 0's orders and maps; at stop its
prompt cache's host tier goes to its disk tier, as process 0's does at close, and its expert
disk tier's stats go to the log.
"""

from __future__ import annotations

import logging

from tidejax.config import EngineConfig
from tidejax.runtime.build import LoadedModel
from tidejax.runtime.runner import Runner

log = logging.getLogger("tidejax")


def follow(config: EngineConfig, channel) -> None:
    """A peer's life: load the same model, then run process 0's plans until it stops."""
    runner = Runner(LoadedModel(config))
    log.info("process %d follows process 0", config.distributed.process_id)
    while True:
        kind, *args = channel.receive()
        if kind == "stop":
            break
        if kind == "boot":
            runner.boot(*args)
        elif kind == "plan":
            runner.run(*args)
        elif kind != "ping":
            raise ValueError(f"process 0 sent an unknown message {kind!r}")
        if runner.tiers is not None and (kind != "plan" or args[0].spills or args[0].restores):
            # its prompt cache tiers' counts, for process 0's /metrics (its disk writes land
            # between plans: a ping's report has them)
            channel.send(("tiers", runner.tiers.stats()))
    log.info("process %d: %d verify steps run", config.distributed.process_id,
             runner.verify_steps)
    cache = runner.model.residency.cache
    if cache is not None:  # its own disk tier's reads (process 0's are in its stats)
        log.info("process %d: disk tier %s", config.distributed.process_id, cache.stats())
    try:  # its prompt cache's host tier to its disk tier, as process 0's at close
        runner.close_tiers()
    except Exception:
        log.exception("could not write the prompt cache's host tier to disk at stop")
    channel.close()  # out of jax.distributed first (Follower.close)
    log.info("process %d: process 0 stopped", config.distributed.process_id)

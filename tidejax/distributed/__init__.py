"""Several processes as one model: start-up ([distributed]), the boot guard and the channel.

    start(config) -> None (one process) | channel.Leader (process 0) | channel.Follower

At start, before anything touches a device: the peers connect to process 0's channel and pass
the boot guard (guard.py: the same profile, checkpoint and versions, or a ConfigError naming
what differs), then `jax.distributed.initialize` joins them (CPU collectives through gloo), so
jax.devices() lists every process's devices and tidejax.parallel's mesh spans them. Process 0
serves HTTP and schedules; the others run its plans (peer.py: a runner fed process 0's plans).

A peer that is gone (killed, its host down): process 0 notices within distributed.heartbeat_s
(its pings, or the next plan or collective failing), fails the requests in flight and the
queue, and reports "failed" with the reason on /health, serving nothing more until restarted;
it does not abort (jax_enable_recoverability) and exits cleanly on SIGTERM. A peer whose
process 0 is gone is ended by jax's coordination client (SIGABRT) as soon as that client sees
the coordinator go: jax.distributed.initialize offers no way to take that error instead (the
client's missed-heartbeat callback is not among its arguments).
"""

from __future__ import annotations

import jax

from tidejax.config import EngineConfig
from tidejax.distributed import guard
from tidejax.distributed.channel import Follower, Leader
from tidejax.errors import ConfigError


def check(config: EngineConfig) -> None:
    """What the [distributed] keys say together (after every --set and variable): process_id
    below num_processes, a coordinator for several processes, and for several processes with a
    host budget a residency.state_dir (their disk tier's shard copies)."""
    section = config.distributed
    if section.process_id >= section.num_processes:
        raise ConfigError(f"{config.source_of('distributed.process_id')}: "
                          f"'distributed.process_id' = {section.process_id} should be below "
                          f"distributed.num_processes ({section.num_processes})")
    if section.num_processes > 1 and not section.coordinator:
        raise ConfigError(f"{config.source_of('distributed.num_processes')}: "
                          "'distributed.coordinator' (host:port of process 0) is needed for "
                          f"distributed.num_processes = {section.num_processes}")
    residency = config.residency
    host_budget = residency.host_budget_experts or residency.host_budget_gib
    if section.num_processes > 1 and host_budget and not residency.state_dir:
        # refused here, before the processes join: a refusal at load ends one process first,
        # and jax's coordination client then aborts the other (SIGABRT, above)
        key = ("residency.host_budget_experts" if residency.host_budget_experts
               else "residency.host_budget_gib")
        raise ConfigError(f"{config.source_of(key)}: across {section.num_processes} processes "
                          "each reads its shards of the experts from a prepared copy of them; "
                          "set residency.state_dir")


def start(config: EngineConfig) -> Leader | Follower | None:
    """Joins this process to its peers (see above); None where the profile has one process."""
    check(config)
    section = config.distributed
    if section.num_processes == 1:
        return None
    ours = guard.fingerprint(config)
    if section.process_id == 0:
        channel = Leader(section, ours, guard.differences)
    else:
        channel = Follower(section, ours)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # without it, jax's coordination service aborts process 0 (SIGABRT) once a peer misses its
    # heartbeats: process 0 fails its requests instead and says why (Leader.watch)
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(section.coordinator, section.num_processes,
                                   section.process_id, initialization_timeout=section.timeout_s,
                                   heartbeat_timeout_seconds=section.heartbeat_s,
                                   coordinator_bind_address=section.coordinator)  # not [::]
    except Exception as e:  # jax raises several kinds (RuntimeError, XlaRuntimeError)
        channel.close()
        raise ConfigError(f"{config.source_of('distributed.coordinator')}: "
                          "jax.distributed.initialize at distributed.coordinator = "
                          f"{section.coordinator} failed for process {section.process_id} of "
                          f"{section.num_processes} within "
                          f"distributed.timeout_s = {section.timeout_s} s: {e}") from None
    return channel

"""Routing traces over two processes on loopback (tests/residency/test_trace.py has one): the
router's picks are replicated, so process 0 alone records them, and its trace counted per
(layer, expert) is the demand history process 0 drained; the peer runs the same steps but has no
recorder and writes nothing."""

from __future__ import annotations

import json
import textwrap

from tests.support.server_fixtures import (free_coordinator, run_pair, write_chat_model,
                                           write_profile)
from tests.support.traces import PROMPTS, check_trace_is_what_was_counted, traced

LEADER = textwrap.dedent("""
    import json, logging, sys
    from tidejax import distributed
    from tidejax.config import EngineConfig
    from tidejax.runtime.engine import Engine

    said = []  # what residency logged (the recorder says where it records)
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("tidejax.residency").addHandler(handler)
    logging.getLogger("tidejax.residency").setLevel(logging.INFO)
    config = EngineConfig.from_toml(sys.argv[1]).with_overrides({"distributed": {"process_id": 0}})
    engine = Engine(config, distributed.start(config))
    for prompt in json.loads(sys.argv[2]):
        engine.generate(prompt, max_new_tokens=5)
    stats = engine.residency.stats()
    engine.close()  # the last chunk written; the peer stops too
    print(json.dumps({"stats": stats, "recording": [m for m in said if "recording" in m]}))
""")


def test_process_0_records_the_trace_of_two_processes(tmp_path):
    state_dir = tmp_path / "state"
    profile = write_profile(tmp_path / "pair.toml", write_chat_model(tmp_path / "tiny"),
                            **traced(state_dir),
                            distributed={"num_processes": 2, "coordinator": free_coordinator(),
                                         "timeout_s": 120})
    got = run_pair(profile, LEADER, json.dumps(PROMPTS), timeout=300)
    assert len(got["recording"]) == 1 and str(state_dir / "routing") in got["recording"][0]
    peer_log = (tmp_path / "pair-peer.log").read_text()
    assert "process 1: process 0 stopped" in peer_log  # it ran every plan to the end
    # residency's log is there, but no recorder's: no header, no chunks, no host copies
    assert "residency: 4 of 8 experts resident" in peer_log and "recording" not in peer_log
    trace = check_trace_is_what_was_counted(state_dir, got["stats"])
    assert trace["header"]["model"] == "tiny" and len(trace["step"]) > len(PROMPTS)

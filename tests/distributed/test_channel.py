"""The channel between process 0 and its peers (tidejax.distributed.channel), over a real
socket on this host: process 0 keeps each peer's latest report, skips one it cannot read (the
stream stays in step), and a peer's send after process 0 closed raises ConnectionError."""

import dataclasses
import logging
import socket
import threading
import time

import pytest

from tidejax.config import DistributedSection
from tidejax.distributed import channel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ends():
    """(process 0's Leader, process 1's Follower) joined through the boot guard."""
    section = DistributedSection(coordinator=f"127.0.0.1:{free_port() - 1}", num_processes=2,
                                 timeout_s=10, heartbeat_s=2)
    peer = {}
    follower = threading.Thread(target=lambda: peer.update(end=channel.Follower(
        dataclasses.replace(section, process_id=1), {})))
    follower.start()
    leader = channel.Leader(section, {}, lambda ours, theirs: [])
    follower.join(10)
    return leader, peer["end"]


def wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_process_0_keeps_the_latest_report_and_skips_what_does_not_read(caplog):
    leader, follower = ends()
    with caplog.at_level(logging.WARNING, logger="tidejax"):
        follower.sock.sendall(channel._LENGTH.pack(3) + b"xyz")  # not a pickle
        follower.send(5)  # not a (kind, report) pair
        follower.send(("tiers", {"host": {"pages": 1}}))
        follower.send(("tiers", {"host": {"pages": 2}}))
        wait_for(lambda: leader.reports().get(1) == {"host": {"pages": 2}})
    assert sum("does not read" in r.message for r in caplog.records) == 2
    assert all(listener.is_alive() for listener in leader._listeners)
    follower.sock.close()  # the peer's end closed: the listener ends, close() returns at once
    wait_for(lambda: not any(listener.is_alive() for listener in leader._listeners))
    leader.close()


def test_a_peers_report_after_process_0_closed_raises_connection_error():
    leader, follower = ends()
    follower.sock.shutdown(socket.SHUT_WR)  # as a stopped peer: process 0's close returns
    leader.close()
    with pytest.raises(ConnectionError, match="process 0 closed the channel"):
        for _ in range(100):  # the first sends may still land in the socket's buffer
            follower.send(("tiers", {}))
            time.sleep(0.01)

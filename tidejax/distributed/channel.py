"""The channel from process 0 to its peers: one TCP connection each, ordered messages.

Process 0 listens on the coordinator's host at the coordinator's port + 1; every peer connects
at start, sends its boot-guard fingerprint and receives process 0's verdict; from then on
process 0 sends, and the peers receive, its boot map, then each plan its runner carries out
(tidejax.runtime.runner), then stop; between them process 0 pings every heartbeat_s / 5
seconds (`Leader.watch`), so that a peer that is gone is noticed while nothing is asked of it:
its connection refuses the next message. The other way a peer sends only reports of its own
state for process 0's /metrics (its prompt cache tiers' counts: tidejax.distributed.peer),
which a thread of process 0's per peer keeps, the latest of each (`Leader.reports`). Messages
are pickled: the channel joins the processes of one deployment, which trust each other (bind it
to a private network).

Why a socket and not what JAX offers. `multihost_utils.broadcast_one_to_all` sends arrays of a
shape every process knows beforehand, through a jitted psum over the devices: a plan is Python
data of varying size, so each would take two broadcasts (its length, then its bytes), a device
all-reduce of the bytes and a compile for every new length. The coordination service's
key-value store has no public Python client (`jax._src.distributed.global_state.client` is
private and changed between releases), keeps every message as a named key in the coordinator
until deleted, and gives no order: the peers need the plans one after the other, as a stream
gives them.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import threading
import time

import jax

from tidejax.config import DistributedSection
from tidejax.errors import ConfigError

_LENGTH = struct.Struct("<Q")
log = logging.getLogger("tidejax")


def channel_address(section: DistributedSection) -> tuple[str, int]:
    """(host, port) of process 0's channel: the coordinator's host, its port + 1."""
    host, _, port = section.coordinator.rpartition(":")
    return host, int(port) + 1


def _send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("process 0 closed the channel")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _receive_bytes(sock: socket.socket) -> bytes:
    """One message's pickled bytes (its length first)."""
    (n,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    return _receive_exactly(sock, n)


def _receive(sock: socket.socket):
    return pickle.loads(_receive_bytes(sock))


class Leader:
    """Process 0's end: its peers' connections, in process order."""

    def __init__(self, section: DistributedSection, fingerprint: dict, compare):
        """Waits distributed.timeout_s for every peer; `compare(ours, theirs)` lists the fields
        a peer's fingerprint differs in. Any difference: every peer is told, then ConfigError."""
        host, port = channel_address(section)
        server = socket.create_server((host, port))
        server.settimeout(section.timeout_s)
        peers: dict[int, socket.socket] = {}
        wrong: dict[int, list[str]] = {}
        deadline = time.monotonic() + section.timeout_s
        try:
            while len(peers) < section.num_processes - 1:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, section.num_processes)) - set(peers))
                    raise ConfigError(
                        f"distributed: process(es) {missing} did not connect to {host}:{port} "
                        f"within distributed.timeout_s = {section.timeout_s} s") from None
                sock.settimeout(section.timeout_s)
                process_id, theirs = _receive(sock)
                peers[process_id] = sock
                differ = compare(fingerprint, theirs)
                if differ:
                    wrong[process_id] = differ
        finally:
            server.close()
        verdict = _verdict(wrong)
        for sock in peers.values():
            sock.settimeout(None)
            _send(sock, verdict)
        if verdict:
            raise ConfigError(verdict)
        self.peers = [peers[i] for i in sorted(peers)]
        self.heartbeat_s = section.heartbeat_s
        self.lost = ""  # why a peer is gone ("" while every one answers)
        self._lock = threading.Lock()  # one message at a time: the plans' and the pings'
        self._closed = threading.Event()
        self._reports: dict[int, object] = {}  # process -> its last report
        self._listeners = [threading.Thread(target=self._listen, args=(process, sock),
                                            name=f"tidejax-peer-{process}", daemon=True)
                           for process, sock in enumerate(self.peers, 1)]
        for listener in self._listeners:
            listener.start()

    def send(self, message) -> None:
        """To every peer; ConnectionError (naming the peer) once one is gone."""
        with self._lock:
            if self.lost:
                raise ConnectionError(self.lost)
            for process, sock in enumerate(self.peers, 1):
                try:
                    _send(sock, message)
                except OSError as e:
                    self.lost = f"distributed: process {process} is gone ({e})"
                    raise ConnectionError(self.lost) from None

    def _listen(self, process: int, sock: socket.socket) -> None:
        """A peer's reports ("tiers", counts) until it closes its end (or its connection
        fails: the pings notice that). A report it cannot read is logged and skipped (the
        length before each keeps the stream in step), so the thread ends only with the
        connection, which close() waits for."""
        while True:
            try:
                data = _receive_bytes(sock)
            except OSError:  # ConnectionError too: the peer closed its end
                return
            try:
                kind, report = pickle.loads(data)
            except Exception as e:  # any malformed report: named in the log, skipped
                log.warning("distributed: process %d sent a report that does not read (%r)",
                            process, e)
                continue
            if kind == "tiers":
                self._reports[process] = report
            else:
                log.warning("distributed: process %d sent an unknown report %r", process, kind)

    def reports(self) -> dict[int, object]:
        """{process: its last report} of the peers that sent one."""
        return dict(self._reports)

    def watch(self, interval: float, on_lost) -> None:
        """Pings the peers every `interval` seconds on a thread of its own; the first that fails
        calls `on_lost(reason)` and the pings end (so do they at close)."""
        def pings():
            while not self._closed.wait(interval):
                try:
                    self.send(("ping",))
                except ConnectionError:
                    on_lost(self.lost)
                    return
        threading.Thread(target=pings, name="tidejax-peer-pings", daemon=True).start()

    def close(self) -> None:
        """Waits (up to heartbeat_s each) for the peers to close their ends, which they do once
        stopped and out of jax.distributed (peer.follow), then closes: a peer that still polled
        process 0's coordination service when it went would be aborted by jax's client."""
        self._closed.set()
        with self._lock:
            for sock, listener in zip(self.peers, self._listeners):
                if not self.lost:  # its listener ends where the peer closes its end
                    listener.join(self.heartbeat_s)
                with contextlib.suppress(OSError):  # a listener still reading returns
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class Follower:
    """A peer's end: connects to process 0 (retrying until distributed.timeout_s), passes the
    boot guard, then receives process 0's messages in order."""

    def __init__(self, section: DistributedSection, fingerprint: dict):
        address = channel_address(section)
        deadline = time.monotonic() + section.timeout_s
        while True:
            try:
                self.sock = socket.create_connection(address, timeout=section.timeout_s)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"distributed: process 0 did not come up at {address[0]}:{address[1]} "
                        f"within distributed.timeout_s = {section.timeout_s} s") from None
                time.sleep(0.2)
        _send(self.sock, (section.process_id, fingerprint))
        verdict = _receive(self.sock)
        if verdict:
            raise ConfigError(verdict)
        self.sock.settimeout(None)

    def receive(self):
        return _receive(self.sock)

    def send(self, report) -> None:
        """A report to process 0 (Leader.reports keeps the latest); ConnectionError, as
        receive's, once process 0 has closed the channel."""
        try:
            _send(self.sock, report)
        except OSError as e:
            raise ConnectionError(f"process 0 closed the channel ({e})") from None

    def close(self) -> None:
        """Leaves jax.distributed, then closes: process 0 waits for this end to close before it
        stops its coordination service, and jax's client aborts a process whose coordination
        service goes first."""
        jax.distributed.shutdown()
        self.sock.close()


def _verdict(wrong: dict[int, list[str]]) -> str:
    """The boot guard's refusal naming each process and field that differs ("" = none)."""
    return "; ".join(f"distributed: process {i} differs from process 0 in {', '.join(fields)}"
                     for i, fields in sorted(wrong.items())) + (
        " (the same profile and checkpoint are needed on every process)" if wrong else "")

"""Issue 17, item 2, and issue 31, item 4: memory before authentication. A peer that
has not authenticated cannot make the daemon buffer a frame larger than about a
megabyte (libzmq refuses it as soon as it reads the size; larger requests come in
signed parts), cannot hold more than ``--max-connections`` connections, and cannot fill
the log: rejected messages are logged a few lines per interval and summarized. Real
daemons, loopback only, bounded loops."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import sys
import time

import msgpack
import pytest
import zmq
from _hardening_daemon import ServedDaemon, closed_by_peer, rss_bytes, settled_rss, zmtp_connect
from _wait import GENEROUS_S, wait_for

from hapd.errors import DaemonTimeout, ProtocolError, RemoteError
from hapd.serve.daemon import DEFAULT_MAX_CONNECTIONS, FRAME_SLACK_BYTES, preauth_bytes
from hapd.serve import guard
from hapd.serve.guard import REJECT_LOG_BURST, RateLimitedLog, shorten
from hapd.wire.protocol import MAGIC, PART_BYTES, Limits, PartedMessages, Session

pytestmark = pytest.mark.daemon

LIMIT = 1 << 20
"""``--max-request-bytes`` of these daemons."""
FLOOD = 300
"""Unsigned messages sent in the log flood test."""


def test_a_frame_over_the_limit_is_refused_before_it_is_buffered(tmp_path):
    """A peer declares a frame of 1.5× the request limit (more than the limit plus its
    slack) and sends the start of it: the daemon disconnects it at once instead of
    waiting to buffer the whole frame; an honest client is served throughout."""
    declared = LIMIT + LIMIT // 2
    assert declared > LIMIT + FRAME_SLACK_BYTES
    with ServedDaemon(tmp_path / "hapd", "--max-request-bytes", str(LIMIT)) as daemon:
        sock = zmtp_connect(daemon.port)
        try:
            sock.sendall(bytes([0x02]) + declared.to_bytes(8, "big") + b"\0" * 4096)
            wait_for(lambda: closed_by_peer(sock), GENEROUS_S, "the daemon to drop the peer of an oversized frame")
        finally:
            sock.close()
        with daemon.client() as client:
            assert client.ping()["profile_name"] == "paper-8"


def test_an_unfinished_message_of_many_frames_is_cut_off(tmp_path):
    """Frames each under the limit, all of one message that never ends (libzmq would
    buffer them all): once the connection has sent more than one whole request without
    authenticating, the daemon shuts it down and says why."""
    frame = LIMIT // 2
    most = 64  # 32 MiB: far more than one request of 1 MiB
    with ServedDaemon(tmp_path / "hapd", "--max-request-bytes", str(LIMIT)) as daemon:
        sock = zmtp_connect(daemon.port)
        try:
            for _ in range(most):
                sock.sendall(bytes([0x03]) + frame.to_bytes(8, "big") + b"\0" * frame)  # long frame, MORE
        except OSError:
            pass  # shut down while sending
        try:
            wait_for(lambda: closed_by_peer(sock), GENEROUS_S, "the daemon to cut off the peer")
        finally:
            sock.close()
        daemon.wait_log(r"refused a connection from 127\.0\.0\.1:\d+: \d+ bytes received before any authenticated message")
        with daemon.client() as client:
            assert client.ping()["profile_name"] == "paper-8"


def test_an_authenticated_connection_has_no_byte_budget(tmp_path):
    """After its first authenticated message a connection may send any number of
    requests of any allowed size."""
    graph = b"\0" * (LIMIT - 4096)  # not a graph: answered with an error, after authentication
    with ServedDaemon(tmp_path / "hapd", "--max-request-bytes", str(LIMIT)) as daemon:
        with daemon.client(timeout_s=GENEROUS_S) as client:
            client.ping()
            for _ in range(4):  # 4 MiB in all, four times the budget of an unauthenticated peer
                with pytest.raises(RemoteError, match="GraphFormatError"):
                    client.compile(graph, "hapg")
            assert client.ping()["profile_name"] == "paper-8"
        assert "refused a connection" not in daemon.log()


def test_a_frame_just_over_the_body_limit_still_reaches_the_checks(tmp_path):
    """Within the slack, an oversized body is read and rejected by the session with a
    log line naming it (what the operator needs to raise --max-request-bytes)."""
    with ServedDaemon(tmp_path / "hapd", "--max-request-bytes", str(LIMIT)) as daemon, daemon.client() as client:
        _, frames = client.session.encode("compile", {"graph": b"\0" * (LIMIT + 16), "graph_kind": "hapg"})
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(daemon.address)
            sock.send_multipart(frames)
            daemon.wait_log(r"rejected a message from 127\.0\.0\.1: ProtocolError: oversized body")
        finally:
            sock.close()


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_connections_beyond_the_bound_are_refused(tmp_path):
    """With --max-connections 2, two connected peers (unauthenticated ones included)
    leave no room for a third: its ping is never answered and the refusal is logged;
    when one of the two leaves, the third gets in."""
    assert DEFAULT_MAX_CONNECTIONS >= 8  # a launcher holds two connections per daemon
    with ServedDaemon(tmp_path / "hapd", "--max-connections", "2") as daemon:
        with daemon.client(timeout_s=GENEROUS_S) as first:
            first.ping()  # connected and admitted
            squatter = _dealer(daemon.address)
            squatter.send_multipart([b"hello"])  # unauthenticated: rejected, but the connection stays
            daemon.wait_log(r"rejected a message from 127\.0\.0\.1")
            try:
                with daemon.client(timeout_s=2.0) as third:
                    with pytest.raises(DaemonTimeout):
                        third.ping()
                daemon.wait_log(r"refused a connection from 127\.0\.0\.1:\d+: 2 connections are open")
            finally:
                squatter.close()
            # room again once the daemon has seen the squatter go (a request sent over a
            # connection refused before that is lost: ask again)
            wait_for(lambda: _pings(daemon), GENEROUS_S, "a new connection to be admitted")
            assert first.ping()["profile_name"] == "paper-8"


def _pings(daemon: ServedDaemon) -> bool:
    try:
        with daemon.client(timeout_s=2.0) as client:
            return client.ping()["profile_name"] == "paper-8"
    except DaemonTimeout:
        return False


def test_a_flood_of_rejected_messages_writes_a_bounded_log(tmp_path):
    """300 unsigned messages: at most the burst of lines per interval, the rest counted
    in a summary line; every one of them is accounted for."""
    with ServedDaemon(tmp_path / "hapd") as daemon, daemon.client(timeout_s=GENEROUS_S) as client:
        sock = _dealer(daemon.address)
        try:
            header = msgpack.packb({"id": "0" * 32, "type": "ping", "time": time.time(), "session": "x"})
            for _ in range(FLOOD):
                sock.send_multipart([MAGIC, b"1", b"0" * 64, header, b"\x80"])
            # one connection's messages are read in order: once this one's ping is
            # answered, the flood before it on the same socket has been read too
            _, frames = client.session.encode("ping")
            sock.send_multipart(frames)
            assert sock.poll(int(GENEROUS_S * 1000)), "no pong after the flood"
            client.session.decode(sock.recv_multipart(), reply=True)
        finally:
            sock.close()
        summary = daemon.wait_log(r"rejected messages and refused connections: (\d+) more in the last \d+ s")
        log = daemon.log()
        lines = log.count("rejected a message from")
        summarized = sum(int(n) for n in re.findall(r"rejected messages and refused connections: (\d+) more", log))
        assert lines + summarized == FLOOD, log[-2000:]
        assert lines <= 2 * REJECT_LOG_BURST  # the flood may straddle two intervals
        assert summary and "AuthError: bad signature ×" in log


def test_rate_limited_log_summarizes_each_interval(caplog):
    now = [0.0]
    limited = RateLimitedLog(__import__("logging").getLogger("hapd.test"), "things", burst=2, interval_s=10.0,
                             clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="hapd.test"):
        for i in range(5):
            limited.warning("kind A" if i % 2 else "kind B", f"line {i}")
        now[0] = 10.0
        limited.flush()
        limited.warning("kind A", "line 5")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[:2] == ["line 0", "line 1"]
    assert messages[2] == "things: 3 more in the last 10 s, not logged one by one (kind B ×2, kind A ×1)"
    assert messages[3] == "line 5"


def test_shorten_bounds_text_and_says_how_long_it_was():
    assert shorten("abc", 5) == "abc"
    assert shorten("x" * 100_000, 10) == "x" * 10 + "… (100000 characters)"


# ----------------------------------------------------------------------------- issue 31: small frames, parts

BIG_FRAME = 200 * 2**20
"""The unsigned frames of the probe (each far over any frame the daemon accepts)."""
BIG_FRAMES = 4
MAX_PREAUTH_GROWTH = 50 * 2**20
"""The daemon may grow by less than this while refusing them (it buffered 200 MiB each before)."""






def test_the_default_preauth_budget_is_about_a_megabyte():
    assert preauth_bytes(256 * 2**20) < 2 * 2**20
    assert preauth_bytes(4096) < 256 * 2**10


def test_unsigned_200_mib_frames_do_not_grow_the_default_daemon(tmp_path):
    """Four peers each send an unsigned message with a 200 MiB frame to a daemon with the
    default limits: each is disconnected as soon as its frame's size is read, the daemon
    grows by far less than one such frame, and a signed 3 MiB request still goes through
    (in parts)."""
    frame = memoryview(bytes(BIG_FRAME))
    with ServedDaemon(tmp_path / "hapd") as daemon:
        before = settled_rss(daemon.pid)
        peak = before
        socks = [_dealer(daemon.address) for _ in range(BIG_FRAMES)]
        try:
            for sock in socks:
                sock.send_multipart([MAGIC, b"1", b"0" * 64, b"\x80", frame], copy=False)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes(daemon.pid))
                time.sleep(0.05)
        finally:
            for sock in socks:
                sock.close()
        with daemon.client(timeout_s=GENEROUS_S) as client:
            with pytest.raises(RemoteError, match="GraphFormatError"):  # read whole, in parts, then refused as a graph
                client.compile(b"\0" * (3 * 2**20), "hapg")
            assert client.ping()["profile_name"] == "paper-8"
        after = rss_bytes(daemon.pid)
    print(f"daemon RSS {before / 2**20:.1f} MiB before {BIG_FRAMES} unsigned {BIG_FRAME >> 20} MiB frames, peak "
          f"{peak / 2**20:.1f} MiB, {after / 2**20:.1f} MiB after them and a 3 MiB signed request", file=sys.stderr)
    assert peak - before < MAX_PREAUTH_GROWTH, f"grew {(peak - before) / 2**20:.1f} MiB"


def test_a_shipped_script_of_several_megabytes_arrives_whole_in_parts(tmp_path):
    """A launch whose script is 3 MiB (three parts and some): the rank runs exactly it."""
    filler = "# " + "z" * 1000 + "\n"
    script = "import hashlib\nprint(hashlib.sha256(open(__file__, 'rb').read()).hexdigest(), flush=True)\n"
    script += filler * (3 * 2**20 // len(filler) + 1)
    assert len(script) > 3 * PART_BYTES
    with ServedDaemon(tmp_path / "hapd") as daemon, daemon.client(timeout_s=GENEROUS_S) as client:
        client.launch("big", "big.py", script_bytes=script.encode(), nproc=1, world_size=1, master_addr="127.0.0.1",
                      master_port=29500)
        seen: list[dict] = []
        done = False
        while not done:
            events, done = client.job_events("big", seen[-1]["seq"] if seen else 0)
            seen.extend(events)
            time.sleep(0.05)
    assert [e["line"] for e in seen if e["stream"] == "stdout"] == [hashlib.sha256(script.encode()).hexdigest()]


KEY = b"k" * 32


def _parts(body_bytes: int, part_bytes: int = 1000) -> list:
    client = Session(KEY)
    messages = client.encode_request("compile", {"graph": b"\x07" * body_bytes, "graph_kind": "hapg"},
                                     part_bytes=part_bytes)
    daemon = Session(KEY, limits=Limits(max_body_bytes=part_bytes + 100))
    return [daemon.decode(frames) for _, frames in messages]


def test_parts_join_into_the_whole_request():
    parts = _parts(5000)
    assert len(parts) == 6 and all(p.type == "part" for p in parts)
    joined = PartedMessages(1 << 20)
    assert [joined.add(p) for p in parts[:-1]] == [None] * 5
    whole = joined.add(parts[-1])
    assert (whole.type, whole.body, whole.id) == ("compile", {"graph": b"\x07" * 5000, "graph_kind": "hapg"}, parts[-1].id)
    assert len(joined) == 0
    assert len(_parts(900)) == 1  # a body under the part size goes whole


def test_bad_parts_are_refused_and_what_came_is_dropped():
    parts = _parts(5000)
    joined = PartedMessages(1 << 20)
    joined.add(parts[0])
    with pytest.raises(ProtocolError, match="part 2 came where part 1 was expected"):
        joined.add(parts[2])
    assert len(joined) == 0
    with pytest.raises(ProtocolError, match="whose first part never came"):
        joined.add(parts[1])
    with pytest.raises(ProtocolError, match="oversized body: 50[0-9]+ bytes > 4096"):
        PartedMessages(4096).add(parts[0])


def test_unfinished_parted_requests_are_bounded_and_expire():
    now = [0.0]
    joined = PartedMessages(1 << 20, window_s=60.0, max_messages=2, clock=lambda: now[0])
    firsts = [_parts(3000)[0] for _ in range(3)]
    for part in firsts:
        joined.add(part)
        now[0] += 1.0
    assert len(joined) == 2  # the oldest was forgotten
    now[0] += 61.0
    joined.add(_parts(3000)[0])
    assert len(joined) == 1  # the others expired


@contextlib.contextmanager
def _gate():
    """A connection gate on a router bound to a free loopback port (its thread not started)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        gate = guard.ConnectionGate(ctx, router, f"tcp://127.0.0.1:{port}", max_connections=4, preauth_bytes=1024,
                                    refusals=RateLimitedLog(logging.getLogger("test"), "refusals"))
        try:
            yield gate
        finally:
            gate.close()
    finally:
        router.close(linger=0)
        ctx.term()


def test_a_reused_descriptor_is_trusted_under_its_new_peer(monkeypatch):
    """A connection that closed left its descriptor trusted under its peer; a new
    connection on the same descriptor that authenticates is trusted under its own peer,
    not counted against the pre-authentication budget as a stranger (a client sending
    its second 1 MiB part was refused so)."""
    peers = iter(["127.0.0.1:5001", "127.0.0.1:5002"])
    monkeypatch.setattr(guard, "_peer_of", lambda fd, local: next(peers))
    with _gate() as gate:
        gate.trust(9)
        gate.trust(9)  # the same descriptor, now another connection's
        assert gate._trusted[9] == "127.0.0.1:5002"


def test_a_connection_trusted_while_its_bytes_are_counted_is_not_cut(monkeypatch):
    """The gate counts a connection's bytes after taking its list of untrusted ones; a
    request in parts may be authenticated in between (its later parts already arrived):
    the gate decides again under its lock and leaves the connection alone."""
    monkeypatch.setattr(guard, "_peer_of", lambda fd, local: "127.0.0.1:5001")
    cut: list[int] = []
    monkeypatch.setattr(guard, "_shut_down", lambda fd, local: cut.append(fd) or "127.0.0.1:5001")
    with _gate() as gate:

        def counted_while_trusted(fd, local):
            gate.trust(fd)  # the daemon authenticates its first part meanwhile
            return "127.0.0.1:5001", 3 * 2**20

        monkeypatch.setattr(guard, "_bytes_received", counted_while_trusted)
        gate._admitted.add(9)
        gate._check_budgets()
        assert cut == [] and gate.refused_total == 0
        monkeypatch.setattr(guard, "_bytes_received", lambda fd, local: ("127.0.0.1:5002", 3 * 2**20))
        gate._check_budgets()  # a stranger on the descriptor: cut
        assert cut == [9] and gate.refused_total == 1


def test_a_late_close_event_keeps_the_new_connections_trust(monkeypatch):
    """The close event of a connection is read after a newer connection took its
    descriptor and authenticated: the newer one stays trusted (its bytes were counted
    as a stranger's and it was cut mid-request)."""
    monkeypatch.setattr(guard, "_peer_of", lambda fd, local: "127.0.0.1:5002")
    with _gate() as gate:
        gate._admitted.add(9)
        gate.trust(9)  # the new connection on descriptor 9
        gate._forget(9)  # the old connection's close event, read late
        assert gate._trusted[9] == "127.0.0.1:5002"
        monkeypatch.setattr(guard, "_peer_of", lambda fd, local: None)  # descriptor 9 closed for real
        gate._forget(9)
        assert 9 not in gate._trusted

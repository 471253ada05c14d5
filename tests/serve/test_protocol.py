"""The control protocol without sockets: signing, every rejection, the key file, and
fuzzing of the message decoder and the graph IR loader (hypothesis)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis.errors import NoSuchExample
from hypothesis import strategies as st

from hapd.errors import AuthError, GraphError, HapdError, ProtocolError
from hapd.wire.keys import load_key, load_or_create_key
from hapd.wire.protocol import (MAGIC, PROTOCOL_VERSION, REPLIES, REQUESTS, Limits, Message, Session, split_envelope,
                                 validate_body)

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pair(**limits) -> tuple[Session, Session]:
    clock = Clock()
    return Session(KEY, clock=clock, limits=Limits(**limits)), Session(KEY, clock=clock, limits=Limits(**limits))


def signed(session: Session, header: bytes, body: bytes, version: bytes = b"1") -> list[bytes]:
    return [MAGIC, version, session.sign(version, header, body), header, body]


# ----------------------------------------------------------------------------- round trips

SAMPLE_REQUESTS = {
    "ping": {},
    "compile": {"graph": b"\x80", "graph_kind": "hapg", "options": {"zero": True}},
    "status": {},
    "shutdown": {},
    "launch": {
        "job": "j1", "script": "train.py", "args": ["--steps", "3"], "env": {"A": "1"}, "nproc": 2, "node_rank": 0,
        "nnodes": 1, "rank_offset": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": 29500, "start_at": 5.5,
    },
    "job_status": {"job": "j1"},
    "job_events": {"job": "j1", "after": 0},
    "cancel": {"job": "j1"},
    "pause": {"job": "j1"},
    "park": {"job": "j1", "generation": 0},
    "switch": {"job": "j1", "generation": 1, "node_rank": 0, "nnodes": 2, "rank_offset": 0, "world_size": 4,
               "master_addr": "127.0.0.1", "master_port": 29501, "env": {"HAPD_GENERATION": "1"}},
    "snapshot_put": {"run": "j1", "step": 40, "rank": 1, "world": 2, "count": 2, "name": "__1_0.distcp", "offset": 0,
                     "total": 3, "data": b"abc"},
    "snapshot_list": {"run": "j1"},
    "snapshot_get": {"run": "j1", "step": 40, "rank": 1, "name": "__1_0.distcp", "offset": 0, "length": 3},
    "snapshot_drop": {"run": "j1", "before_step": 40},
    "part": {"message": "a" * 32, "type": "compile", "index": 0, "count": 2, "size": 10, "data": b"\x82\xa5"},
}


def test_every_request_type_round_trips():
    assert set(SAMPLE_REQUESTS) == set(REQUESTS)
    client, daemon = pair()
    for mtype, body in SAMPLE_REQUESTS.items():
        message, frames = client.encode(mtype, body)
        assert frames[0] == MAGIC and frames[1] == str(PROTOCOL_VERSION).encode() and len(frames[2]) == 64
        got = daemon.decode(frames)
        assert (got.type, got.body, got.id, got.session) == (mtype, body, message.id, client.session)


def test_replies_carry_their_parent():
    client, daemon = pair()
    request, _ = client.encode("ping")
    _, frames = daemon.encode("pong", {"protocol": 1, "version": "x", "host": "h", "profile_id": "p", "profile_name": "n", "slots": 1, "jobs": 0}, parent=request.id)
    reply = client.decode(frames, reply=True)
    assert reply.parent == request.id and reply.type == "pong"


def test_message_types_are_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    for table in (REQUESTS, REPLIES):
        for mtype in table.values():
            assert f"`{mtype.name}`" in doc, mtype.name
            for f in mtype.fields:
                assert f"`{f.name}`" in doc, (mtype.name, f.name)


# ----------------------------------------------------------------------------- rejections


def test_wrong_key_is_rejected():
    _, frames = Session(OTHER).encode("ping")
    with pytest.raises(AuthError, match="bad signature"):
        Session(KEY).decode(frames)


@pytest.mark.parametrize("frame", [1, 2, 3, 4])
def test_a_flipped_byte_is_rejected(frame):
    client, daemon = pair()
    _, frames = client.encode("compile", {"graph": b"graph-bytes", "graph_kind": "hapg"})
    data = bytearray(frames[frame])
    data[len(data) // 2] ^= 0x01
    frames[frame] = bytes(data)
    with pytest.raises(ProtocolError) as info:  # AuthError is a ProtocolError
        daemon.decode(frames)
    if frame == 1:
        assert "protocol version" in str(info.value)
    else:
        assert isinstance(info.value, AuthError)


def test_replayed_message_is_rejected():
    client, daemon = pair()
    _, frames = client.encode("ping")
    daemon.decode(frames)
    with pytest.raises(AuthError, match="replayed"):
        daemon.decode(frames)


class Ticking(Clock):
    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_replay_memory_overflow_never_lets_a_replay_through():
    clock = Ticking()
    client, daemon = Session(KEY, clock=clock), Session(KEY, clock=clock, limits=Limits(seen_ids=2))
    sent = [client.encode("ping")[1] for _ in range(4)]
    for frames in sent:
        daemon.decode(frames)
    for frames in sent:  # the first two were forgotten, but their times are below the floor
        with pytest.raises(AuthError):
            daemon.decode(frames)


@pytest.mark.parametrize("skew", [-61.0, 61.0])
def test_stale_or_future_messages_are_rejected(skew):
    clock = Clock()
    client, daemon = Session(KEY, clock=clock), Session(KEY, clock=clock)
    _, frames = client.encode("ping")
    clock.now += skew
    with pytest.raises(AuthError, match="stale"):
        daemon.decode(frames)


def test_unknown_type_is_rejected():
    client, daemon = pair()
    with pytest.raises(ProtocolError, match="unknown message type"):
        client.encode("rm_rf")
    header = msgpack.packb({"id": "a" * 32, "type": "rm_rf", "time": client.clock(), "session": "s"})
    message = daemon.open(signed(client, header, b"\x80"))  # authentic...
    with pytest.raises(ProtocolError, match="unknown request type 'rm_rf'"):
        daemon.check(message)  # ...but nothing it asks for exists


def test_oversized_frames_are_rejected_before_the_signature_is_checked():
    client, daemon = pair(max_body_bytes=1024, max_header_bytes=256)
    body = msgpack.packb({"graph": b"x" * 2000, "graph_kind": "hapg"})
    header = msgpack.packb({"id": "b" * 32, "type": "compile", "time": client.clock(), "session": "s"})
    with pytest.raises(ProtocolError, match="oversized body"):
        daemon.open([MAGIC, b"1", b"0" * 64, header, body])  # an unchecked signature
    with pytest.raises(ProtocolError, match="oversized header"):
        daemon.open([MAGIC, b"1", b"0" * 64, header + b"\x00" * 300, b"\x80"])


@pytest.mark.parametrize("version", [b"2", b"0", b"", b"1.0", b"\xff"])
def test_wrong_protocol_version_is_rejected(version):
    client, daemon = pair()
    _, frames = client.encode("ping")
    frames[1] = version
    frames[2] = client.sign(version, frames[3], frames[4])  # even correctly signed
    with pytest.raises(ProtocolError, match="protocol version"):
        daemon.decode(frames)


def test_malformed_messages_are_rejected():
    client, daemon = pair()
    now = client.clock()
    good_header = msgpack.packb({"id": "c" * 32, "type": "ping", "time": now, "session": "s"})
    cases = {
        "frame count": [MAGIC, b"1", b"0" * 64, good_header],
        "delimiter": [b"HAPD", b"1", b"0" * 64, good_header, b"\x80"],
        "unsigned": [MAGIC, b"1", b"", good_header, b"\x80"],
        "header not msgpack": signed(client, b"\xc1", b"\x80"),
        "header not a map": signed(client, msgpack.packb([1, 2]), b"\x80"),
        "bad id": signed(client, msgpack.packb({"id": "zz", "type": "ping", "time": now, "session": "s"}), b"\x80"),
        "bad time": signed(client, msgpack.packb({"id": "d" * 32, "type": "ping", "time": "now", "session": "s"}), b"\x80"),
        "extra header field": signed(client, msgpack.packb({"id": "e" * 32, "type": "ping", "time": now, "session": "s", "x": 1}), b"\x80"),
        "body not a map": signed(client, good_header, msgpack.packb([1])),
        "trailing bytes": signed(client, msgpack.packb({"id": "f" * 32, "type": "ping", "time": now, "session": "s"}), b"\x80\x80"),
        "ext type": signed(client, msgpack.packb({"id": "0" * 32, "type": "ping", "time": now, "session": "s"}), msgpack.packb({"a": msgpack.ExtType(5, b"x")})),
        "int map key": signed(client, msgpack.packb({"id": "1" * 32, "type": "ping", "time": now, "session": "s"}), msgpack.packb({1: 2})),
    }
    for name, frames in cases.items():
        with pytest.raises(ProtocolError):
            daemon.decode(frames)
            pytest.fail(name)


def test_body_fields_are_checked():
    launch = REQUESTS["launch"]
    with pytest.raises(ProtocolError, match="'nproc' is missing"):
        validate_body(launch, {k: v for k, v in SAMPLE_REQUESTS["launch"].items() if k != "nproc"})
    with pytest.raises(ProtocolError, match="'nproc' should be int"):
        validate_body(launch, {**SAMPLE_REQUESTS["launch"], "nproc": "2"})
    with pytest.raises(ProtocolError, match="'nproc' should be int"):
        validate_body(launch, {**SAMPLE_REQUESTS["launch"], "nproc": True})
    with pytest.raises(ProtocolError, match="unknown field 'sudo'"):
        validate_body(launch, {**SAMPLE_REQUESTS["launch"], "sudo": True})
    with pytest.raises(ProtocolError, match="'env' should be str_map"):
        validate_body(launch, {**SAMPLE_REQUESTS["launch"], "env": {"A": 1}})


def test_split_envelope():
    assert split_envelope([b"\x00id", MAGIC, b"1"]) == ([b"\x00id"], [MAGIC, b"1"])
    with pytest.raises(ProtocolError, match="delimiter"):
        split_envelope([b"\x00id", b"x"])
    with pytest.raises(ProtocolError, match="frames"):
        split_envelope([b""] * 40)


# ----------------------------------------------------------------------------- key files


def test_key_file_is_created_private_and_reused(tmp_path):
    path = tmp_path / "state" / "key"
    key = load_or_create_key(path)
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path) == key == load_key(path)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "key"
    load_or_create_key(path)
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match="chmod 600"):
        load_key(path)


def test_bad_or_missing_key_files(tmp_path):
    with pytest.raises(AuthError, match="no key file"):
        load_key(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.write_text("not hex")
    os.chmod(bad, 0o600)
    with pytest.raises(AuthError, match="hex digits"):
        load_key(bad)
    with pytest.raises(AuthError):
        Session(b"short")


# ----------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
_decoder = Session(KEY, limits=Limits(max_body_bytes=4096, max_header_bytes=1024))


@FUZZ
@given(st.lists(st.binary(max_size=80), max_size=8))
def test_fuzz_raw_frames(frames):
    """Arbitrary frames: rejected with a ProtocolError, never anything else."""
    with pytest.raises(ProtocolError):
        _decoder.decode(frames, replay=False)


@FUZZ
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_fuzz_signed_garbage(header, body):
    """Correctly signed garbage reaches the decoders: still only ProtocolError."""
    try:
        _decoder.decode(signed(_decoder, header, body), replay=False)
    except ProtocolError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


_mtypes = st.sampled_from(sorted(REQUESTS) + ["pong", "bogus"])
_bodies = st.dictionaries(st.text(max_size=12), _values, max_size=6)
_whens = st.floats(allow_nan=True) | st.integers(-(2**63), 2**63 - 1)


def _decode_structured(mtype: str, body: dict, when: float | int) -> Message | None:
    """A signed message of type ``mtype`` with ``body``, sent at ``when`` (an odd integer:
    now), as the decoder reads it; None where it is rejected with a ProtocolError."""
    header = msgpack.packb({"id": os.urandom(16).hex(), "type": mtype, "time": _decoder.clock() if isinstance(when, int) and when % 2 else when, "session": "s"})
    try:
        return _decoder.decode(signed(_decoder, header, msgpack.packb(body, use_bin_type=True)), replay=False)
    except ProtocolError:
        return None


@settings(FUZZ, max_examples=1000)
@given(_mtypes, _bodies, _whens)
def test_fuzz_signed_structured_bodies(mtype, body, when):
    """Well-formed msgpack of any shape under any type: accepted only if it checks."""
    message = _decode_structured(mtype, body, when)
    if message is not None:
        validate_body(REQUESTS[message.type], message.body)


_MLP = (Path(__file__).resolve().parents[1] / "fixtures" / "mlp.hapg").read_bytes()


@st.composite
def _mutated_graph(draw) -> bytes:
    data = bytearray(_MLP)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if how == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif how == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif how == "cut":
            del data[pos:]
        elif how == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
    return bytes(data)


def _loads(data: bytes) -> bool:
    """Whether the core's graph reader accepts ``data`` (False: a GraphError)."""
    from hapd import _core

    try:
        _core.load_graph(data)
    except GraphError:
        return False
    return True


@FUZZ
@given(st.one_of(st.binary(max_size=400), _mutated_graph()))
def test_fuzz_graph_ir_loader(data):
    """The core's graph reader (and, for graphs it accepts, a short search) raises a
    GraphError or another HapdError for any bytes: never a panic or a crash."""
    from hapd import _core
    from hapd.profile.schema import estimated_profile

    if not _loads(data):
        return
    profile = estimated_profile(2)
    try:
        _core.synthesize(data, profile.core_bytes(), [0.5, 0.5], {"max_states": 2000})
    except HapdError:
        pass


def _reaches(strategy: st.SearchStrategy, condition: Callable[[Any], bool]) -> bool:
    """Whether ``strategy`` generates some value that meets ``condition``."""
    try:
        find(strategy, condition, settings=settings(database=None, derandomize=True, max_examples=1000))
    except NoSuchExample:
        return False
    return True


def test_the_fuzz_inputs_reach_past_the_first_check():
    """The fuzz tests see both outcomes of the check their inputs meet first: some
    mutated graphs still load (so the search behind the reader is fuzzed too) and some
    do not; some structured bodies pass the decoder (so ``validate_body`` is fuzzed)
    and some do not."""
    assert _reaches(_mutated_graph(), lambda data: data != _MLP and _loads(data))
    assert _reaches(_mutated_graph(), lambda data: not _loads(data))
    assert _reaches(st.tuples(_mtypes, _bodies, _whens), lambda args: _decode_structured(*args) is not None)
    assert _reaches(st.tuples(_mtypes, _bodies, _whens), lambda args: _decode_structured(*args) is None)


def test_client_and_protocol_import_without_torch():
    import subprocess
    import sys

    code = "import sys, hapd.wire.client, hapd.wire.protocol, hapd.serve.jobs; print(sorted(m for m in ('torch', 'pulp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

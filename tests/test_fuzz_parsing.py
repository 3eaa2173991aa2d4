"""Property tests (hypothesis) of everything that parses outside input: request bodies,
sampling parameters, kv_transfer_params, side-channel frames and their authentication,
and transfer descriptors. Whatever comes in, the result is a value that satisfies the
invariants, or the one documented error type — never another exception."""

from __future__ import annotations

import math
import time

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvpush.crypto.auth import ChannelAuth
from kvpush.errors import RequestError
from kvpush.kv_transfer.params import MAX_ID_CHARS, KVTransferParams, block_ids_problem
from kvpush.kv_transfer.transfer_thread.push_prefill import registration_problem
from kvpush.kv_transfer.transports.transport import RegionInfo, TransferPostError, validate_post
from kvpush.kv_transfer.wire import messages as m
from kvpush.kv_transfer.wire.side_channel import SideChannel
from kvpush.sampling_params import SamplingParams, SamplingParamsError
from kvpush.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

COMPLETION_KEYS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "n", "stream", "stream_options",
                   "logprobs", "echo", "logit_bias", "kv_transfer_params", "model", "suffix",
                   "presence_penalty", "frequency_penalty", "repetition_penalty"]
CHAT_KEYS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "logprobs",
             "top_logprobs", "tools", "response_format", "stream", "stop", "seed"]


def bodies(keys: list[str]) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(keys), json_values, max_size=6)


@FAST
@given(body=bodies(COMPLETION_KEYS) | json_values)
def test_completion_request_parses_or_raises_validation_error(body):
    raw = msgspec.json.encode(body)
    try:
        req = CompletionRequest.model_validate_json(raw)
    except pydantic.ValidationError as e:
        assert e.errors()  # the server turns these into one 400
        return
    assert isinstance(req.prompt, str) or all(
        isinstance(t, int) and not isinstance(t, bool) for t in req.prompt)
    for name in ("max_tokens", "top_k", "seed", "n", "logprobs"):
        v = getattr(req, name)
        assert v is None or (isinstance(v, int) and not isinstance(v, bool))


@FAST
@given(body=bodies(CHAT_KEYS) | st.fixed_dictionaries(
    {"messages": st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]),
                                          json_values, max_size=3), max_size=3)}))
def test_chat_request_parses_or_raises_validation_error(body):
    try:
        req = ChatCompletionRequest.model_validate_json(msgspec.json.encode(body))
    except pydantic.ValidationError:
        return
    for msg in req.messages:
        assert isinstance(msg.role, str)
        assert msg.content is None or isinstance(msg.content, (str, list))


def test_nan_and_infinity_are_refused():
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest.model_validate_json(raw)


@FAST
@given(kw=st.fixed_dictionaries({}, optional={
    "max_tokens": scalars, "temperature": scalars, "top_p": scalars, "top_k": scalars,
    "stop": st.lists(st.text(max_size=5), max_size=20).map(tuple)}))
def test_sampling_params_valid_or_refused(kw):
    try:
        p = SamplingParams(**kw)
    except SamplingParamsError as e:
        assert e.param in ("max_tokens", "temperature", "top_p", "top_k", "stop")
        return
    except TypeError:  # a comparison with a non-number: the HTTP layer never passes one
        assume(False)
        return
    assert isinstance(p.max_tokens, int) and p.max_tokens >= 1
    assert p.temperature >= 0 and 0 < p.top_p <= 1
    assert isinstance(p.top_k, int) and not isinstance(p.top_k, bool) and p.top_k >= -1
    assert all(p.stop) and len(p.stop) <= 16


KV_KEYS = ["do_remote_decode", "do_remote_prefill", "transfer_id", "remote_engine_id",
           "remote_host", "remote_port", "remote_block_ids", "remote_request_id", "tp_size"]
kv_values = (scalars | st.lists(st.integers(-5, 2**64) | st.booleans() | st.none(), max_size=8)
             | st.sampled_from(["127.0.0.1", "host-1.example", "[::1]", "a:b", "", "x" * 300]))


@FAST
@given(params=st.dictionaries(st.sampled_from(KV_KEYS), kv_values, max_size=9)
       | json_values, role=st.sampled_from(["prefill", "decode", "both"]))
def test_parse_kv_params_valid_or_request_error(params, role):
    try:
        out = vars(KVTransferParams.parse(params, role))
    except RequestError as e:
        assert e.param == "kv_transfer_params"
        return
    assert isinstance(out["do_remote_decode"], bool)
    assert isinstance(out["do_remote_prefill"], bool)
    tid = out["transfer_id"]
    assert tid is None or (isinstance(tid, str) and len(tid) <= MAX_ID_CHARS)
    if role == "decode" and out["do_remote_prefill"]:
        host = out["remote_host"]
        assert isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable()
        assert " " not in host and (":" not in host or host.startswith("["))
        assert 0 < out["remote_port"] < 65536 and not isinstance(out["remote_port"], bool)
        ids = out["remote_block_ids"]
        if ids is not None:
            assert len(set(ids)) == len(ids)
            assert all(type(b) is int and 0 <= b < 2**63 for b in ids)


# ---- side channel ---------------------------------------------------------------------

def message_fields() -> st.SearchStrategy[bytes]:
    """Encodings of real messages with random field values (and random bytes)."""
    ints = st.integers(-(2**63), 2**63 - 1)
    reg = st.builds(m.PushRegister, st.text(max_size=8), st.text(max_size=8),
                    st.text(max_size=12), st.lists(ints, max_size=6), ints, ints, st.booleans())
    done = st.builds(m.PushDone, st.text(max_size=8), st.booleans(), ints,
                     st.none() | st.floats())
    hb = st.builds(m.Heartbeat, st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3))
    return st.one_of(reg, done, hb).map(m.encode)


@FAST
@given(payload=st.binary(max_size=200) | message_fields(),
       flips=st.lists(st.integers(0, 10_000), max_size=3))
def test_message_decode_only_raises_msgspec_errors(payload, flips):
    data = bytearray(payload)
    for i in flips:
        if data:
            data[i % len(data)] ^= 0x5A
    try:
        msg = m.decode(bytes(data))
    except (msgspec.DecodeError, msgspec.ValidationError):
        assert m.type_name(bytes(data)) == "?"
        return
    assert type(msg).__name__ == m.type_name(bytes(data))


@FAST
@given(ids=st.lists(st.integers(-3, 40), max_size=8), skip=st.integers(-2, 10),
       n=st.integers(-1, 200), own=st.integers(1, 200), full=st.booleans())
def test_accepted_registrations_stay_inside_decodes_blocks(ids, skip, n, own, full):
    reg = m.PushRegister("t", "d", "h:1", ids, skip, n, full)
    num_blocks, bs = 32, 16
    if registration_problem(reg, num_blocks, bs, own, ()) is not None:
        return
    assert all(0 <= b < num_blocks for b in ids) and len(set(ids)) == len(ids)
    assert 0 <= skip <= len(ids) and n >= 1
    assert own == n
    assert full or len(ids) * bs >= n
    assert block_ids_problem(ids, num_blocks, "x") is None


@FAST
@given(sender=st.binary(max_size=30), payload=st.binary(max_size=60),
       frame=st.none() | st.binary(max_size=80))
def test_channel_auth_refuses_anything_it_did_not_seal(sender, payload, frame):
    auth = ChannelAuth(b"k" * 32)
    reason = auth.check(sender, payload, frame)
    assert reason in ("unsigned", "malformed", "bad_signature")


@FAST
@given(sender=st.binary(min_size=1, max_size=30), payload=st.binary(max_size=60),
       counter=st.integers(1, 2**63), flip=st.integers(0, 59 * 8 - 1))
def test_channel_auth_accepts_its_own_and_no_bit_flip(sender, payload, counter, flip):
    tx, rx = ChannelAuth(b"k" * 32), ChannelAuth(b"k" * 32)
    frame = tx.seal(sender, b"s" * 8, counter, payload)
    bad = bytearray(frame)
    bad[flip // 8] ^= 1 << (flip % 8)
    assert rx.check(sender, payload, bytes(bad)) in ("malformed", "bad_signature")
    assert rx.check(sender, payload, frame) is None
    assert rx.check(sender, payload, frame) == "replayed"


def test_random_frames_on_the_wire_are_dropped_and_counted():
    """Raw ZMQ frames (any count, any bytes) at a signing channel: all refused or
    dropped as malformed; the channel keeps working. The raw socket has the cluster's
    CURVE keys (without them its handshake fails and no frame arrives at all:
    test_side_channel_curve.py), so every frame reaches the MAC check."""
    import random

    import zmq

    from kvpush.crypto.curve import derive_curve_keys, make_client

    rng = random.Random(7)
    secret = b"s" * 32
    with SideChannel("127.0.0.1", 0, secret=secret) as rx, \
            SideChannel("127.0.0.1", 0, secret=secret) as good:
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        make_client(raw, derive_curve_keys(secret))
        raw.connect(f"tcp://{rx.address}")
        try:
            n = 200
            for _ in range(n):
                frames = [rng.randbytes(rng.randint(0, 80)) for _ in range(rng.randint(1, 4))]
                raw.send_multipart(frames)
            deadline = time.monotonic() + 10
            while rx.stats.rejected + rx.stats.malformed < n:
                assert time.monotonic() < deadline, rx.stats
                assert rx.recv(20) == []
        finally:
            raw.close(0)
        assert good.send(rx.address, b"still fine")
        deadline = time.monotonic() + 5
        got = []
        while not got:
            assert time.monotonic() < deadline
            got = rx.recv(20)
        assert got == [(good.address, b"still fine")]


# ---- transfer descriptors ---------------------------------------------------------------

ranges = st.lists(st.tuples(st.integers(-(2**64), 2**64), st.integers(-(2**64), 2**64)),
                  max_size=6)


@FAST
@given(local=ranges, remote=ranges, op=st.sampled_from(["WRITE", "READ", "COPY"]))
def test_validate_post_never_lets_a_range_out_of_its_region(local, remote, op):
    lreg, rreg = RegionInfo(0x10000, 0x1000), RegionInfo(0x80000, 0x800)
    try:
        loc, rem = validate_post(op, local, remote, lreg, rreg)
    except TransferPostError:
        return
    assert op in ("WRITE", "READ") and len(loc) == len(rem) > 0
    for (a, n), (b, k) in zip(loc.tolist(), rem.tolist()):
        assert n == k > 0
        assert lreg.contains(a, n) and rreg.contains(b, k)


@FAST
@given(x=st.floats(allow_nan=True, allow_infinity=True))
def test_floats_in_ranges_are_refused_or_truncated_inside(x):
    lreg = RegionInfo(0x10000, 0x1000)
    try:
        loc, _ = validate_post("WRITE", [(x, 16)], [(0x10000, 16)], lreg, lreg)
    except TransferPostError:
        return
    assert math.isfinite(x) and lreg.contains(int(loc[0][0]), 16)

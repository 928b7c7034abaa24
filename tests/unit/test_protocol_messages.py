"""Protocol bodies: every op round-trips through the codec; construction and decode validate."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from array import array
from pathlib import Path
from types import MappingProxyType

import msgpack
import pytest

import protocol as p
from protocol.messages import U64_MAX

REPO = Path(__file__).resolve().parents[2]

# One request and one result per op; test_every_op_has_a_sample keeps this table complete.
SAMPLES: dict[str, tuple[p.Body, p.Body]] = {
    "hello": (
        p.HelloRequest(token="s3cret", client="test"),
        p.HelloResult(
            protocol_version=1,
            server="tpcache 0.1.0",
            world_size=2,
            page_size=16,
            layout="L2xH4xD64:bf16",
            max_message_bytes=16 << 20,
        ),
    ),
    "match": (
        p.MatchRequest(tokens=array("i", [5, 0, 2**31 - 1, 7]), namespace="tenant-a", storage=True),
        p.MatchResult(hit_tokens=32, device_pages=1, host_pages=1, storage_pages=0, device_page_ids=[9]),
    ),
    "lock": (
        p.LockRequest(tokens=[1, 2, 3], prefetch="timeout", timeout_rounds=4),
        p.LockResult(lease=U64_MAX, hit_tokens=0, device_pages=0, host_pages=0, storage_pages=3, device_page_ids=[]),
    ),
    "prefetch": (
        p.PrefetchRequest(lease=3, policy="best_effort"),
        p.PrefetchResult(status="running", storage_pages=4, ready_pages=1),
    ),
    "release": (p.ReleaseRequest(lease=0), p.ReleaseResult()),
    "abort": (p.AbortRequest(lease=12), p.AbortResult()),
    "insert": (
        p.InsertRequest(tokens=range(32), device_page_ids=[4, 5], lease=3),
        p.InsertResult(inserted_pages=1, duplicate_pages=1),
    ),
    "append": (
        p.AppendRequest(tokens=range(16), device_page_ids=[6], lease=3),
        p.AppendResult(inserted_pages=1, duplicate_pages=0),
    ),
    "alloc": (p.AllocRequest(lease=3, num_pages=2), p.AllocResult(device_page_ids=[10, 11])),
    "load": (p.LoadRequest(lease=3), p.LoadResult(device_page_ids=[12])),
    "step": (p.StepRequest(), p.StepResult(round=41)),
    "flush": (p.FlushRequest(), p.FlushResult(round=42)),
    "stats": (p.StatsRequest(), p.StatsResult(values={"rounds": 42, "hit_rate": 0.5, "state": "open"})),
    "health": (p.HealthRequest(), p.HealthResult(state="closed", reason="state digest mismatch", round=7)),
    "set_config": (
        p.SetConfigRequest(retention_cap_tokens=-1, mirror_release=False),
        p.SetConfigResult(settings={"retention_cap_tokens": -1, "mirror_release": False}),
    ),
    "register_buffers": (
        p.RegisterBuffersRequest(
            descriptors=[
                {"rank": 0, "kind": "shm", "name": "/tpcache-kv-0", "size": 1 << 20},
                {"rank": 1, "kind": "cuda_ipc", "handle": b"\x01\x02", "size": 1 << 20, "offset": None},
            ]
        ),
        p.RegisterBuffersResult(registered=2),
    ),
    "put_pages": (
        p.PutPagesRequest(page_ids=[1, 2], data=b"ab" * 8, lease=None),
        p.PutPagesResult(written_pages=2),
    ),
    "get_pages": (p.GetPagesRequest(page_ids=[1, 2], lease=5), p.GetPagesResult(data=bytearray(b"ab" * 8))),
}


def test_every_op_has_a_sample() -> None:
    assert set(SAMPLES) == set(p.REQUEST_TYPES) == set(p.RESULT_TYPES)
    for op, (req, res) in SAMPLES.items():
        assert op == req.OP and op == res.OP


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_request_round_trip(op: str) -> None:
    body, _ = SAMPLES[op]
    request = p.Request(2**63 + 5, body)
    decoded = p.decode_request(p.encode_request(request))
    assert decoded == request
    assert type(decoded.body) is type(body) and decoded.op == op
    # Re-encoding the decoded request gives the same bytes: encoding is canonical.
    assert p.encode_request(decoded) == p.encode_request(request)


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_result_round_trip(op: str) -> None:
    _, result = SAMPLES[op]
    response = p.ok_response(3, result)
    decoded = p.decode_response(p.encode_response(response))
    assert decoded == response and decoded.ok and decoded.op == op
    assert decoded.unwrap() == result


def test_wire_shape_of_a_match_request() -> None:
    frame = p.encode_request(p.Request(9, p.MatchRequest(tokens=[1, 256])))
    obj = msgpack.unpackb(frame)
    assert obj == {
        "v": 1,
        "id": 9,
        "op": "match",
        "args": {"tokens": b"\x01\x00\x00\x00\x00\x01\x00\x00", "namespace": ""},
    }


def test_none_fields_are_left_out_and_read_back_as_none() -> None:
    frame = p.encode_request(p.Request(1, p.InsertRequest(tokens=[1], device_page_ids=[2])))
    assert "lease" not in msgpack.unpackb(frame)["args"]
    assert p.decode_request(frame).body.lease is None


def test_bodies_hold_canonical_types() -> None:
    body = p.InsertRequest(tokens=(1, 2), device_page_ids=range(3))
    assert type(body.tokens) is array and body.tokens.typecode == "i"
    result = p.StatsResult(values={"b": 1, "a": 2})
    assert isinstance(result.values, MappingProxyType) and list(result.values) == ["a", "b"]
    with pytest.raises(TypeError):
        result.values["c"] = 3  # type: ignore[index]
    reg = SAMPLES["register_buffers"][0]
    assert isinstance(reg.descriptors, tuple)
    assert SAMPLES["get_pages"][1].data == b"ab" * 8 and type(SAMPLES["get_pages"][1].data) is bytes


@pytest.mark.parametrize(
    "build",
    [
        lambda: p.MatchRequest(tokens=[-1]),
        lambda: p.MatchRequest(tokens=[2**31]),
        lambda: p.MatchRequest(tokens=["1"]),
        lambda: p.MatchRequest(tokens=b"\x01\x00\x00\x00"),
        lambda: p.MatchRequest(tokens=[1], namespace=3),
        lambda: p.MatchRequest(tokens=[1], namespace="x" * 257),
        lambda: p.ReleaseRequest(lease=-1),
        lambda: p.ReleaseRequest(lease=2**64),
        lambda: p.ReleaseRequest(lease=True),
        lambda: p.ReleaseRequest(lease=1.0),
        lambda: p.AllocRequest(lease=1, num_pages=0),
        lambda: p.SetConfigRequest(),
        lambda: p.SetConfigRequest(retention_cap_tokens=-2),
        lambda: p.SetConfigRequest(mirror_release=1),
        lambda: p.HealthResult(state="half-open", reason="", round=0),
        lambda: p.RegisterBuffersRequest(descriptors=[]),
        lambda: p.RegisterBuffersRequest(descriptors=[{"rank": [0]}]),
        lambda: p.RegisterBuffersRequest(descriptors=[{"": 0}]),
        lambda: p.StatsResult(values={"x": b"bytes not allowed in stats"}),
        lambda: p.StatsResult(values={"x": 2**64}),
        lambda: p.PutPagesRequest(page_ids=[1, 2], data=b"abc"),
        lambda: p.PutPagesRequest(page_ids=[], data=b"a"),
        lambda: p.Request(-1, p.StepRequest()),
        lambda: p.Request(1, p.StepResult(round=1)),
        lambda: p.Response(1, result=p.StepRequest()),
        lambda: p.Response(None, result=p.StepResult(round=1)),
        lambda: p.Response(1),
        lambda: p.Response(1, error="boom"),
        lambda: p.ErrorInfo("1", "BAD_MESSAGE", "m"),
    ],
)
def test_construction_rejects_bad_values(build) -> None:
    with pytest.raises(p.InvalidArgument):
        build()


def test_ids_helpers() -> None:
    ids = array("i", [0, 1, 2**31 - 1])
    data = p.pack_ids(ids)
    assert data == b"\x00\x00\x00\x00\x01\x00\x00\x00\xff\xff\xff\x7f"
    assert p.unpack_ids(data) == ids
    assert p.pack_ids([3, 4]) == p.pack_ids(array("q", [3, 4]))
    assert p.unpack_ids(b"") == array("i")
    with pytest.raises(p.InvalidArgument, match="whole number"):
        p.unpack_ids(b"\x00" * 5)
    with pytest.raises(p.InvalidArgument, match="non-negative"):
        p.unpack_ids(b"\x00\x00\x00\x80")
    with pytest.raises(p.InvalidArgument, match="non-negative"):
        p.pack_ids(array("i", [1, -5]))
    with pytest.raises(p.MessageTooLarge):
        p.unpack_ids(b"\x00" * 12, max_count=2)
    with pytest.raises(p.InvalidArgument, match="bin"):
        p.unpack_ids(bytearray(4))  # type: ignore[arg-type]
    assert p.as_id_array([7]) == array("i", [7])


def test_error_reply_maps_back_to_the_same_exception_type() -> None:
    for code, cls in p.errors.ERROR_TYPES.items():
        reply = p.decode_response(p.encode_response(p.error_response(5, cls("boom"))))
        assert not reply.ok and reply.error is not None
        assert reply.error.code == int(code) and reply.error.name == code.name
        with pytest.raises(cls, match="boom") as info:
            reply.unwrap()
        assert type(info.value) is cls and info.value.request_id == 5


def test_unknown_error_code_becomes_internal_error() -> None:
    exc = p.exception_for(999, "from a newer server")
    assert type(exc) is p.InternalError and "999" in exc.message


def test_error_response_hides_non_protocol_exceptions_and_bounds_messages() -> None:
    reply = p.error_response(1, KeyError("secret internal detail"))
    assert reply.error == p.ErrorInfo(int(p.ErrorCode.INTERNAL), "INTERNAL", "internal error (KeyError)")
    long = p.error_response(None, p.InvalidArgument("x" * 5000, request_id=8))
    assert long.id == 8 and len(long.error.message) == 1024
    p.decode_response(p.encode_response(long))  # still within the decoder's string limit


def test_error_codes_are_stable() -> None:
    # Wire numbers must never change; this table is the contract in README.md.
    assert {c.name: int(c) for c in p.ErrorCode} == {
        "BAD_MESSAGE": 1,
        "TOO_LARGE": 2,
        "UNSUPPORTED_VERSION": 3,
        "UNKNOWN_OP": 4,
        "BAD_ARGUMENT": 5,
        "UNAUTHORIZED": 6,
        "CACHE_CLOSED": 7,
        "NOT_FOUND": 8,
        "OVERLOADED": 9,
        "TIMEOUT": 10,
        "INTERNAL": 11,
        "DUPLICATE_REQUEST": 12,
        "NO_SPACE": 13,
    }


def test_protocol_imports_without_torch_numpy_zmq_or_tpcache() -> None:
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "numpy", "zmq", "tpcache"):
                    raise ImportError("protocol must not import " + name)
        sys.meta_path.insert(0, Block())
        import protocol
        from protocol import codec, connection, errors, ids, limits, messages
        req = protocol.Request(1, protocol.MatchRequest(tokens=[1, 2]))
        assert protocol.decode_request(protocol.encode_request(req)) == req
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

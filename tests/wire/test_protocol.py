"""Protocol round trips (hypothesis) and the framing of raw id frames."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.wire.errors import ERROR_CODES, SidecarError
from kvsidecar.wire.framing import decode_ids, encode_ids
from kvsidecar.wire.protocol import (
    REQUEST_TAGS,
    Error,
    FixLayout,
    Heartbeat,
    Hello,
    HostAlloc,
    Move,
    Register,
    Reply,
    Request,
    Status,
)
from kvsidecar.wire.types import (
    BufferDescriptor,
    BufferSetRef,
    LayerSpec,
    LayoutSpec,
    ShmRef,
    WorkerRef,
)

names = st.text(min_size=1, max_size=12)
small = st.integers(min_value=0, max_value=64)
refs = st.builds(WorkerRef, names, small, small, small)
sets = st.builds(BufferSetRef, refs, st.sampled_from(["device", "host"]))
descs = st.builds(
    BufferDescriptor,
    st.sampled_from(["kv_first", "blocks_first", "split", "mla"]),
    st.sampled_from(["NHD", "HND"]),
    st.sampled_from(["float16", "bfloat16", "float32"]),
    st.integers(1, 1 << 20),
    st.integers(1, 256),
    st.integers(1, 128),
    st.integers(1, 1024),
)
ids_ = st.integers(min_value=0, max_value=2**63 - 1)
requests = st.one_of(
    st.builds(Hello, id=ids_, protocol_version=small, client_name=names),
    st.builds(Status, id=ids_),
    st.builds(Heartbeat, id=ids_, workers=st.lists(refs, max_size=4)),
    st.builds(HostAlloc, id=ids_, engine_id=names, count=small),
    st.builds(Move, id=ids_, src=sets, dst=sets, layers=st.none() | st.lists(names, max_size=3)),
    st.builds(
        FixLayout,
        id=ids_,
        target=sets,
        remote=st.builds(LayoutSpec, st.sampled_from(["NHD", "HND"]), st.integers(1, 64)),
    ),
    st.builds(
        Register,
        id=ids_,
        protocol_version=small,
        worker=refs,
        layers=st.lists(
            st.builds(LayerSpec, names, descs, st.builds(ShmRef, small, small, small, small)),
            max_size=3,
        ),
        fd_token=st.binary(max_size=16),
    ),
)


@given(requests)
def test_every_request_round_trips(req: Request) -> None:
    decoded = msgspec.msgpack.Decoder(Request).decode(msgspec.msgpack.encode(req))
    assert decoded == req


@given(ids_, st.sampled_from(sorted(ERROR_CODES)), st.text(max_size=50))
def test_errors_round_trip(rid: int, code: str, message: str) -> None:
    err = Error(id=rid, code=code, message=message)  # type: ignore[arg-type]
    assert msgspec.msgpack.Decoder(Reply).decode(msgspec.msgpack.encode(err)) == err


def test_unknown_error_code_is_rejected() -> None:
    raw = msgspec.msgpack.encode({"type": "error", "id": 1, "code": "oops", "message": ""})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(Reply).decode(raw)


def test_tags_are_unique_and_complete() -> None:
    members = Request.__args__  # type: ignore[attr-defined]
    tags = [m.__struct_config__.tag for m in members]
    assert len(tags) == len(set(tags)), "two requests share a tag"
    assert set(tags) == REQUEST_TAGS
    assert {"hello", "register", "move", "fix_layout", "status"} <= REQUEST_TAGS


@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=100), st.sampled_from(["int32", "int64"])
)
def test_id_frames_round_trip(values: list[int], dtype: str) -> None:
    arr = encode_ids(values, dtype)  # type: ignore[arg-type]
    back = decode_ids(memoryview(arr.tobytes()), dtype, max_ids=1000, what="x")  # type: ignore[arg-type]
    assert back.tolist() == values


def test_id_frame_limits() -> None:
    with pytest.raises(SidecarError) as info:
        decode_ids(b"\x00" * 7, "int32", max_ids=10, what="x")
    assert info.value.code == "bad_frame"
    with pytest.raises(SidecarError) as info:
        decode_ids(np.zeros(11, np.int64).tobytes(), "int64", max_ids=10, what="x")
    assert info.value.code == "too_large"

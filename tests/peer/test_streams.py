"""The ZMQ plane's data streams (peer/streams.py, `PeerLink.read` and `read_all`), real sockets.

A small producer runs on a thread of the test with its own ZeroMQ context and a ROUTER on
loopback TCP: it answers each `ReadBlocks` with the requested byte ranges of a source array
(or, per test, with a wrong frame, late, or not at all). The consumer side is the real
`PeerLink` with several data streams. What lands is compared element by element with the
source, indexed by hand.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvsidecar.peer.link import PeerGone, PeerLink, PeerRefused
from kvsidecar.peer.messages import PeerError, PeerRequest, ReadBlocks, ReadData

pytestmark = pytest.mark.timeout(60)

Answer = Callable[[ReadBlocks, np.ndarray, np.ndarray], list[Any] | None]
"""How the producer answers one read: the reply frames (header first), or None for silence."""


def honest(msg: ReadBlocks, ranges: np.ndarray, source: np.ndarray) -> list[Any] | None:
    header = msgspec.msgpack.encode(ReadData(id=msg.id, nbytes=int(ranges[:, 2].sum())))
    return [header, *(source[layer, off : off + n] for layer, off, n in ranges.tolist())]


def packed(msg: ReadBlocks, ranges: np.ndarray, source: np.ndarray) -> list[Any] | None:
    """The ranges back to back in one frame (what a producer sends for many small ranges)."""
    nbytes = int(ranges[:, 2].sum())
    header = msgspec.msgpack.encode(ReadData(id=msg.id, nbytes=nbytes, packed=True))
    return [header, b"".join(source[r, o : o + n].tobytes() for r, o, n in ranges.tolist())]


class Producer:
    """A ROUTER on a thread answering reads from ``source`` (layers x bytes) with ``answer``."""

    def __init__(self, source: np.ndarray, answer: Answer = honest) -> None:
        self.source, self.answer = source, answer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.reads = 0
        self.idents: set[bytes] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(PeerRequest)
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, header, *data = self.sock.recv_multipart()
            msg = decoder.decode(header)
            if not isinstance(msg, ReadBlocks):
                continue
            self.reads += 1
            self.idents.add(ident)
            ranges = np.frombuffer(data[0], dtype="<i8").reshape(-1, 3)
            frames = self.answer(msg, ranges, self.source)
            if frames is not None:
                self.sock.send_multipart([ident, *frames], copy=False)
        self.sock.close(linger=0)

    def close(self) -> None:
        """Stop serving and close the socket (the consumer sees the connection drop)."""
        self.stop.set()
        self.thread.join(5)
        self.ctx.term()


class HoldingProducer(Producer):
    """Answers nothing until no read has come for 0.1 s, then all it holds: counts the most
    reads a consumer had outstanding at once (``most_held``)."""

    def __init__(self, source: np.ndarray) -> None:
        self.most_held = 0
        super().__init__(source)

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(PeerRequest)
        held: list[tuple[bytes, ReadBlocks, np.ndarray]] = []
        while not self.stop.is_set():
            if self.sock.poll(100):
                ident, header, *data = self.sock.recv_multipart()
                msg = decoder.decode(header)
                assert isinstance(msg, ReadBlocks)
                self.reads += 1
                held.append((ident, msg, np.frombuffer(data[0], dtype="<i8").reshape(-1, 3)))
                continue
            self.most_held = max(self.most_held, len(held))
            for ident, msg, ranges in held:
                frames = honest(msg, ranges, self.source)
                assert frames is not None
                self.sock.send_multipart([ident, *frames], copy=False)
            held = []
        self.sock.close(linger=0)


@pytest.fixture
def source() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=(3, 1 << 18), dtype=np.uint8)


@pytest.fixture
def link_factory() -> Iterator[Callable[..., PeerLink]]:
    ctx = zmq.asyncio.Context(io_threads=2)
    links: list[PeerLink] = []

    def make(endpoint: str, streams: int = 3, in_flight: int = 8) -> PeerLink:
        link = PeerLink(ctx, endpoint, in_flight, streams=streams)
        links.append(link)
        return link

    yield make
    for link in links:
        assert link.closed, "each test closes its link"
    ctx.term()


def _read(
    link: PeerLink, ranges: np.ndarray, dests: list[np.ndarray], timeout: float = 10.0
) -> Any:
    msg = ReadBlocks(
        id=link.next_id(), engine_id="p", tp_rank=0, pp_rank=0, request_id="r", layers=["a"]
    )
    return link.read(msg, [np.ascontiguousarray(ranges, dtype="<i8")], dests, timeout=timeout)


def _plan(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, list[int]]:
    """``n`` ranges of the 3-layer source and distinct, non-overlapping destination offsets."""
    lengths = rng.integers(1, size, n)
    rows = np.stack([rng.integers(0, 3, n), rng.integers(0, (1 << 18) - size, n), lengths], 1)
    dest_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    return rows.astype(np.int64), dest_offsets


@pytest.mark.parametrize("answer", [honest, packed], ids=["frame per range", "packed"])
async def test_chunks_over_several_streams_land_element_by_element(
    source: np.ndarray, link_factory: Callable[..., PeerLink], answer: Answer
) -> None:
    producer = Producer(source, answer)
    link = link_factory(producer.endpoint, streams=3, in_flight=6)
    rng = np.random.default_rng(0)
    try:
        chunks = [_plan(rng, int(rng.integers(1, 6)), 20000) for _ in range(60)]
        dests = [np.zeros(int(rows[:, 2].sum()), np.uint8) for rows, _ in chunks]

        async def one(i: int) -> None:
            rows, offs = chunks[i]
            views = [dests[i][o : o + n] for o, n in zip(offs, rows[:, 2].tolist(), strict=True)]
            reply = await _read(link, rows, views)
            assert isinstance(reply, ReadData) and reply.nbytes == dests[i].size

        await asyncio.gather(*(one(i) for i in range(len(chunks))))
        for (rows, offs), dest in zip(chunks, dests, strict=True):
            for (layer, off, n), at in zip(rows.tolist(), offs, strict=True):
                np.testing.assert_array_equal(dest[at : at + n], source[layer, off : off + n])
        assert producer.reads == 60
        assert len(producer.idents) == 3, "every stream is a connection of its own"
    finally:
        await link.close()
        producer.close()


async def test_streams_keep_at_most_max_in_flight_reads_outstanding(
    source: np.ndarray, link_factory: Callable[..., PeerLink]
) -> None:
    # Every read is handed to the link at once; the streams' windows (3 + 2 for 5 in flight
    # over 2 streams) bound what the producer is asked for, and the threads refill them.
    producer = HoldingProducer(source)
    link = link_factory(producer.endpoint, streams=2, in_flight=5)
    try:
        rows = np.array([[1, 4096, 512]], dtype=np.int64)
        dests = [np.zeros(512, np.uint8) for _ in range(23)]
        replies = await asyncio.gather(*(_read(link, rows, [d]) for d in dests))
        assert all(isinstance(r, ReadData) and r.nbytes == 512 for r in replies)
        for dest in dests:
            np.testing.assert_array_equal(dest, source[1, 4096 : 4096 + 512])
        assert producer.reads == 23
        assert producer.most_held == 5
    finally:
        await link.close()
        producer.close()


def _shorten(frames: list[Any]) -> None:
    frames[1] = frames[1][:-1]


def _lengthen(frames: list[Any]) -> None:
    frames[1] += b"x"


@pytest.mark.parametrize(
    ("answer", "bend", "error", "untouched"),
    [
        (honest, _shorten, "frame of 99 bytes for 100", False),
        # A packed frame is checked whole before any byte of it is copied out.
        (packed, _lengthen, "packed frame of 131 bytes for 130", True),
    ],
    ids=["frame per range", "packed"],
)
async def test_a_frame_of_the_wrong_size_fails_only_its_chunk(
    source: np.ndarray,
    link_factory: Callable[..., PeerLink],
    answer: Answer,
    bend: Callable[[list[Any]], None],
    error: str,
    untouched: bool,
) -> None:
    def bent_first(msg: ReadBlocks, ranges: np.ndarray, src: np.ndarray) -> list[Any] | None:
        frames = answer(msg, ranges, src)
        if msg.id == 1 and frames is not None:
            bend(frames)
        return frames

    producer = Producer(source, bent_first)
    link = link_factory(producer.endpoint, streams=1)
    rows = np.array([[0, 0, 100], [1, 50, 30]], np.int64)
    try:
        bad = [np.zeros(100, np.uint8), np.zeros(30, np.uint8)]
        with pytest.raises(PeerGone, match=error):
            await _read(link, rows, bad)
        if untouched:
            assert not bad[0].any() and not bad[1].any(), "nothing of a refused frame lands"
        good = [np.zeros(100, np.uint8), np.zeros(30, np.uint8)]
        await _read(link, rows, good)  # the stream goes on: the rest was drained
        np.testing.assert_array_equal(good[0], source[0, :100])
        np.testing.assert_array_equal(good[1], source[1, 50:80])
    finally:
        await link.close()
        producer.close()


async def test_a_chunk_given_up_is_never_written(
    source: np.ndarray, link_factory: Callable[..., PeerLink]
) -> None:
    def late_first(msg: ReadBlocks, ranges: np.ndarray, src: np.ndarray) -> list[Any] | None:
        if msg.id == 1:
            time.sleep(0.4)  # the consumer gives up after 0.1 s; the reply still comes
        return honest(msg, ranges, src)

    producer = Producer(source, late_first)
    link = link_factory(producer.endpoint, streams=1)
    rows = np.array([[2, 1000, 4096]], np.int64)
    try:
        dest = np.zeros(4096, np.uint8)
        with pytest.raises(PeerGone, match="within"):
            await _read(link, rows, [dest], timeout=0.1)
        # The late reply arrives on the same stream before this one's, and is drained by id.
        other = np.zeros(4096, np.uint8)
        await _read(link, rows, [other])
        np.testing.assert_array_equal(other, source[2, 1000:5096])
        assert not dest.any(), "a reply to a read that was given up was written"
    finally:
        await link.close()
        producer.close()


async def test_a_refused_chunk_fails_its_read_all_and_the_rest_never_land(
    source: np.ndarray, link_factory: Callable[..., PeerLink]
) -> None:
    # One `read_all` of six chunks: the second is refused at once, the last four are answered
    # late (after the consumer gave them up). The refusal ends the call; nothing of the four
    # lands afterwards, and the link serves the next read as usual.
    def refuse_second(msg: ReadBlocks, ranges: np.ndarray, src: np.ndarray) -> list[Any] | None:
        if msg.id == 2:
            return [msgspec.msgpack.encode(PeerError(id=2, code="expired", message="no"))]
        if msg.id > 2:
            time.sleep(0.2)
        return honest(msg, ranges, src)

    producer = Producer(source, refuse_second)
    # One stream: the reads reach the (sequential) producer in order, the refusal before the
    # late ones.
    link = link_factory(producer.endpoint, streams=1, in_flight=6)
    rows = np.array([[1, 512, 2048]], np.int64)
    frame = np.ascontiguousarray(rows, dtype="<i8")
    dests = [np.zeros(2048, np.uint8) for _ in range(6)]
    reads = [
        (
            ReadBlocks(
                id=link.next_id(), engine_id="p", tp_rank=0, pp_rank=0, request_id="r", layers=["a"]
            ),
            [frame],
            [d],
        )
        for d in dests
    ]
    try:
        started = time.monotonic()
        with pytest.raises(PeerRefused, match="expired"):
            await link.read_all(reads, timeout=10)
        assert time.monotonic() - started < 0.2, "the refusal did not end the call at once"
        await asyncio.sleep(1.2)  # every late reply has come by now, and was drained
        for late in dests[2:]:
            assert not late.any(), "a chunk given up was written after read_all returned"
        other = np.zeros(2048, np.uint8)
        await _read(link, rows, [other])
        np.testing.assert_array_equal(other, source[1, 512 : 512 + 2048])
    finally:
        await link.close()
        producer.close()


@pytest.mark.parametrize("in_flight", [16, 3])
async def test_producer_gone_mid_stream_fails_every_read_in_flight(
    source: np.ndarray, link_factory: Callable[..., PeerLink], in_flight: int
) -> None:
    # 16: all 12 reads are sent; 3: windows of one read per stream, so when the producer goes,
    # 3 reads wait for answers and 5 are still queued on the streams: all 8 fail at once.
    answered = threading.Event()

    def answer_four(msg: ReadBlocks, ranges: np.ndarray, src: np.ndarray) -> list[Any] | None:
        if msg.id > 4:
            answered.set()
            return None  # silent from here on; then the producer goes away
        return honest(msg, ranges, src)

    producer = Producer(source, answer_four)
    link = link_factory(producer.endpoint, streams=3, in_flight=in_flight)
    rows = np.array([[0, 0, 1 << 16]], np.int64)
    try:
        dests = [np.zeros(1 << 16, np.uint8) for _ in range(12)]
        reads = [asyncio.ensure_future(_read(link, rows, [d], timeout=30)) for d in dests]
        while not answered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        producer.close()
        results = await asyncio.gather(*reads, return_exceptions=True)
        took = time.monotonic() - started
        done = [r for r in results if isinstance(r, ReadData)]
        failed = [r for r in results if isinstance(r, PeerGone)]
        assert len(done) == 4 and len(failed) == 8, results
        assert took < 5, f"reads in flight failed after {took:.1f} s, not on the disconnect"
        for d, r in zip(dests, results, strict=True):
            if isinstance(r, ReadData):
                np.testing.assert_array_equal(d, source[0, : 1 << 16])
        with pytest.raises(PeerGone):  # a broken stream refuses new reads at once
            await _read(link, rows, [np.zeros(1 << 16, np.uint8)], timeout=30)
        assert not link.connected
    finally:
        await link.close()

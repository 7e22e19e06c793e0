"""`PeerService` as the daemon wires it: the daemon's id, one route for completion events.

A real service on a real registry and copy executor, not started (no socket is needed for the
handshake's answer or for the events).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvsidecar.node.config import Config
from kvsidecar.node.executor import CopyExecutor
from kvsidecar.node.identity import mint_daemon_id
from kvsidecar.node.registry import Registry
from kvsidecar.peer.messages import PEER_PROTOCOL_VERSION, PeerHello, PeerWelcome
from kvsidecar.peer.service import PeerService
from kvsidecar.wire.pulls import TakePeerEvents
from kvsidecar.wire.reports import PeerCompletion


def _service(tmp_path: Path, **kwargs: object) -> tuple[PeerService, CopyExecutor]:
    executor = CopyExecutor(1)
    config = Config(runtime_dir=str(tmp_path))
    return PeerService(config, Registry(), executor, **kwargs), executor  # type: ignore[arg-type]


def test_the_daemon_id_is_the_one_the_daemon_gives(tmp_path: Path) -> None:
    given = mint_daemon_id()
    peer, executor = _service(tmp_path, daemon_id=given)
    try:
        welcome = peer.welcome(
            PeerHello(id=1, protocol_version=PEER_PROTOCOL_VERSION, daemon_id="other")
        )
        assert isinstance(welcome, PeerWelcome)
        assert welcome.daemon_id == peer.daemon_id == given
        assert welcome.planes == ["local", "zmq"]
    finally:
        executor.shutdown(wait=True)
    assert re.fullmatch(r".+-\d+-[0-9a-f]{8}", given)
    assert mint_daemon_id() != given


def test_every_event_reaches_the_sink_and_the_queue_once(tmp_path: Path) -> None:
    seen: list[PeerCompletion] = []
    peer, executor = _service(tmp_path, on_completion=seen.append)
    try:
        events = [
            PeerCompletion(engine_id="a", finished_sending=frozenset({"r1"})),
            PeerCompletion(engine_id="b", failed_recving=frozenset({"r2"})),
        ]
        for event in events:
            peer.emit(event)
        assert seen == events
        assert peer.take_events(TakePeerEvents(id=3, engine_id="b")).events == events[1:]
        assert peer.take_events(TakePeerEvents(id=4)).events == events[:1]
        assert peer.take_events(TakePeerEvents(id=5)).events == []
    finally:
        executor.shutdown(wait=True)

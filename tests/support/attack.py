"""Outside-in attackers: the attacker process and raw probes of the daemon's HTTP endpoint.

`Attacker` drives a ``tests.procs.attacker`` process (raw sockets, never the project's
client); `http_status` and `defence_events` read the metrics endpoint over a raw TCP socket, as
a kubelet probe or a hostile client would.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.children import LineChild

PROBE_S = 3.0
"""Seconds a raw probe may take before it counts as unanswered (the daemon answers in ms)."""


class Attacker(LineChild):
    """A `tests.procs.attacker` process; `finish` stops it and returns its counts."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__("attacker", json.dumps(spec), name=f"attacker {spec['attack']}")
        self.spec = spec
        assert self.line(60) == "ready"

    def finish(self) -> dict[str, Any]:
        self.send_line("exit")
        result: dict[str, Any] = json.loads(self.line(60))["result"]
        self.stop()
        return result


def http_status(port: int, path: str = "/healthz", timeout: float = PROBE_S) -> str:
    """One raw HTTP/1.1 GET: "200", another code with the body's first line, or an exception."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError as exc:
        return type(exc).__name__
    if not data:
        return "empty"
    code = data.split(b" ", 2)[1].decode()
    body = data.partition(b"\r\n\r\n")[2].decode(errors="replace").strip()
    return code if code == "200" else f"{code} {body.splitlines()[0][:40] if body else ''}"


def defence_events(port: int) -> dict[tuple[str, str], float]:
    """``kvsidecar_defence_events_total`` from a raw scrape of /metrics, by (plane, event)."""
    with socket.create_connection(("127.0.0.1", port), timeout=PROBE_S) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    text = data.partition(b"\r\n\r\n")[2].decode()
    return {
        (sample.labels["plane"], sample.labels["event"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvsidecar_defence_events"
        for sample in family.samples
    }

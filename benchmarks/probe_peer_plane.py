"""Probe: the ZMQ plane against a raw pyzmq stream, paired round by round, in one run.

Two daemons (`kvsidecar.bench.procs.daemon`: a producer with a loopback peer endpoint and a
consumer), this process the engine worker of both, like ``bench peer``. Each round pulls
``--mib`` MiB over the ZMQ plane and then streams the same bytes raw (PUSH -> PULL in 1 MiB
frames received into a touched buffer, `kvsidecar.bench.peer.raw_zmq`), and prints both rates and
their ratio; at the end the median ratio. ``--pids FILE`` writes the daemons' pids (producer,
consumer) for a profiler (``py-spy record -p PID``) and ``--wait`` waits that many seconds
before the rounds so that a profiler can attach. ``--flag key=value`` passes daemon settings
(``peer_chunk_bytes=8388608``) to both daemons. ``--random``: the caches hold twice the blocks
and each pull reads a random half of them into other random ids (the ranges are single blocks, as
with the block ids an engine's allocator hands out), instead of every block into the same ids.
``--plane nixl``: the pulls go over NIXL, between daemons with NIXL agents. ``--cpu``: also the
CPU time each pull cost the two daemons, by thread (event loop, ZeroMQ I/O threads, the rest),
and each raw stream its two processes (from ``/proc`` and ``getrusage``), per round on average.

    .venv/bin/python benchmarks/probe_peer_plane.py [--mib 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import zmq

from kvsidecar.bench import procs
from kvsidecar.bench.peer import FRAME, _port, _raw_proc
from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches


class RawStream:
    """A raw pyzmq sender process streaming ``nbytes`` on request over one warm connection."""

    def __init__(self, nbytes: int, repeat: int) -> None:
        self.nbytes = nbytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.proc = _raw_proc(
            "zmq-send", f"tcp://127.0.0.1:{port}", str(nbytes), str(FRAME), str(repeat)
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def once(self, dest: np.ndarray) -> float:
        """Seconds to stream ``nbytes`` into ``dest``."""
        assert self.proc.stdin is not None
        view = dest.data
        start = time.perf_counter()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for off in range(0, self.nbytes, FRAME):
            self.sock.recv_into(view[off : off + FRAME])
        return time.perf_counter() - start

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc: object) -> None:
        procs.stop(self.proc, 5)
        self.sock.close(linger=0)
        self.ctx.term()


_TICK = os.sysconf("SC_CLK_TCK")


def _threads_cpu(pid: int, role: str) -> dict[str, float]:
    """CPU seconds so far of process ``pid``'s threads, by kind: ``role/loop``, ``role/zmq-io``
    (libzmq's I/O threads) and ``role/other``."""
    out: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        kind = "loop" if int(tid) == pid else "zmq-io" if name.startswith("ZMQbg/IO") else "other"
        out[f"{role}/{kind}"] += (int(fields[11]) + int(fields[12])) / _TICK
    return dict(out)


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _settings(pairs: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in pairs:
        key, value = kv.split("=", 1)
        out[key] = (
            int(value) if value.isdigit() else {"true": True, "false": False}.get(value, value)
        )
    return out


_serial = itertools.count()


def _pull(
    pc: SidecarClient,
    cc: SidecarClient,
    endpoint: str,
    ids: tuple[list[int], list[int]],
    plane: str = "zmq",
) -> tuple[Any, float]:
    """Publish a fresh request on the producer, then pull it; (the reply, seconds of the pull).

    ``ids``: the producer's block ids and the consumer's.
    """
    rid = f"r{next(_serial)}"
    pc.publish("p", rid, ids[0])
    start = time.perf_counter()
    pulled = cc.pull("c", endpoint, "p", {"r": ids}, remote_request_ids={"r": rid}, plane=plane)
    return pulled, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pids", default="")
    parser.add_argument("--wait", type=float, default=0.0)
    parser.add_argument("--no-raw", action="store_true", help="pulls only")
    parser.add_argument("--random", action="store_true", help="random block ids (see above)")
    parser.add_argument(
        "--plane", default="zmq", choices=["zmq", "nixl"], help="nixl: daemons with NIXL agents"
    )
    parser.add_argument("--cpu", action="store_true", help="CPU per pull and per raw stream")
    parser.add_argument("--flag", action="append", default=[], help="both daemons' setting")
    parser.add_argument(
        "--flag-b", action="append", default=[], help="a second consumer daemon, these settings"
    )
    args = parser.parse_args()
    settings = _settings(args.flag)
    if args.plane == "nixl":
        settings["peer_data_plane"] = "nixl"
    layers, block_bytes = 32, 2 * 16 * 8 * 128 * 2
    blocks = args.mib * 2**20 // (layers * block_bytes)
    nbytes = blocks * layers * block_bytes
    endpoint = f"tcp://127.0.0.1:{_port()}"
    with contextlib.ExitStack() as stack:
        prod_ep, prod = stack.enter_context(
            procs.daemon(peer_endpoint=endpoint, insecure=True, **settings)
        )
        consumers = {"plane": stack.enter_context(procs.daemon(insecure=True, **settings))}
        if args.flag_b:
            b = {**settings, **_settings(args.flag_b)}
            consumers["plane B"] = stack.enter_context(procs.daemon(insecure=True, **b))
        if args.pids:
            Path(args.pids).write_text(f"{prod.pid} {consumers['plane'][1].pid}\n")
        shape = (2, 2 * blocks if args.random else blocks, 16, 8, 128)
        src = allocate_kv_caches(layers, shape, torch.float16)
        for i, t in enumerate(src):
            t.view(torch.int16).view(-1).copy_(
                torch.arange(t.numel(), dtype=torch.int32).to(torch.int16) + i
            )
        raw_dest = torch.ones(nbytes, dtype=torch.uint8).numpy()
        ids = (list(range(blocks)), list(range(blocks)))
        if args.random:
            rng = np.random.default_rng(0)
            ids = tuple(rng.choice(2 * blocks, blocks, replace=False).tolist() for _ in "rl")
        pc = stack.enter_context(SidecarClient(prod_ep, timeout_s=120))
        pc.register_kv_caches({f"l{i}": t for i, t in enumerate(src)}, engine_id="p")
        clients = {}
        for name, (ep, _) in consumers.items():
            dst = allocate_kv_caches(layers, shape, torch.float16)
            cc = stack.enter_context(SidecarClient(ep, timeout_s=120))
            cc.register_kv_caches({f"l{i}": t for i, t in enumerate(dst)}, engine_id="c")
            pulled, _ = _pull(pc, cc, endpoint, ids, args.plane)
            same = all(
                torch.equal(s.view(torch.int16)[:, ids[0]], d.view(torch.int16)[:, ids[1]])
                for s, d in zip(src, dst, strict=True)
            )
            if pulled.failed or not same:
                raise RuntimeError(f"first pull wrong: {pulled}")
            clients[name] = cc
        raw_stream = None
        if not args.no_raw:
            raw_stream = stack.enter_context(RawStream(nbytes, args.rounds + 1))
            raw_stream.once(raw_dest)  # warm: the connection's buffers grow on first use
        time.sleep(args.wait)
        rates: dict[str, list[float]] = {}
        cpu: collections.Counter[str] = collections.Counter()

        def daemons_cpu() -> collections.Counter[str]:
            got: collections.Counter[str] = collections.Counter()
            if args.cpu:
                got.update(_threads_cpu(prod.pid, "producer"))
                got.update(_threads_cpu(consumers["plane"][1].pid, "consumer"))
            return got

        for r in range(args.rounds):
            line = []
            for name, cc in clients.items():
                before = daemons_cpu() if name == "plane" else None
                pulled, seconds = _pull(pc, cc, endpoint, ids, args.plane)
                if before is not None:
                    cpu.update(daemons_cpu() - before)
                rates.setdefault(name, []).append(nbytes / seconds / 1e9)
                if pulled.failed:
                    raise RuntimeError(pulled)
            if raw_stream is not None:
                sender = raw_stream.proc.pid
                if args.cpu:
                    mine, theirs = _self_cpu(), sum(_threads_cpu(sender, "").values())
                took = raw_stream.once(raw_dest)
                if args.cpu:
                    cpu["raw/receiver (this process)"] += _self_cpu() - mine
                    cpu["raw/sender"] += sum(_threads_cpu(sender, "").values()) - theirs
                rates.setdefault("raw", []).append(nbytes / took / 1e9)
            line = [f"{k} {v[-1]:.2f}" for k, v in rates.items()]
            print(f"round {r}: " + ", ".join(line) + " GB/s", flush=True)
        if args.cpu:
            print(f"CPU per round, ms ({args.rounds} rounds; the publish is not counted):")
            for key, seconds in sorted(cpu.items()):
                print(f"  {key:28s} {seconds / args.rounds * 1e3:7.1f}")
            for side in ("producer", "consumer", "raw"):
                total = sum(v for k, v in cpu.items() if k.startswith(side + "/"))
                if total:
                    print(f"  {side + ' total':28s} {total / args.rounds * 1e3:7.1f}")
        base = "raw" if "raw" in rates else "plane"
        for name, values in rates.items():
            ratio = statistics.median(a / b for a, b in zip(values, rates[base], strict=True))
            print(
                f"{name:8s} median {statistics.median(values):.2f} GB/s "
                f"({min(values):.2f}-{max(values):.2f}), paired ratio to {base} {ratio:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``bench peer``: node-to-node pulls between two daemons against raw pyzmq and raw NIXL.

Two daemon processes on this host (a producer with a loopback peer endpoint, a consumer); this
process is the engine worker of both: ``layers`` tensors of ``(2, blocks, *block_shape)``
(kv_first, K and V) in shared memory per engine. Pulled: the first quarter and all of the blocks
of every layer, contiguous ids, with ``pull(plane="zmq")`` and, where NIXL is installed,
``pull(plane="nixl")``; timed on the client from sending the pull to its reply (handshake, reads
and notifications included); the bytes are checked once per plane and size.

Baselines between two processes, same byte counts: raw pyzmq PUSH -> PULL over loopback TCP in
1 MiB zero-copy frames, received with ``copy=False`` (frames dropped) and received into a touched
destination (``recv_into``, what a transfer must do); raw NIXL: one READ of the same bytes in
1 MiB descriptors from another process's registered buffer, polled with the plane's backoff.
The plane's repetitions run first, then the baseline's (the raw sender streams on request).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Literal

import numpy as np
import torch
import zmq

from kvsidecar.bench import procs
from kvsidecar.bench.common import (
    BenchUnavailable,
    Figure,
    Options,
    Progress,
    note,
    torch_dtype,
)
from kvsidecar.client import SidecarClient
from kvsidecar.memory import allocate_kv_caches

FRAME = 1 << 20
RAW_INTO = "raw pyzmq stream into a buffer"
RAW_NO_COPY = "raw pyzmq stream, no copy"
RAW_NIXL = "raw NIXL READ"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raw_proc(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvsidecar.bench.peer_raw", *args],
        env=procs.child_env(),
        preexec_fn=procs.die_with_parent,  # noqa: PLW1509 - only a prctl, safe before exec
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def raw_zmq(nbytes: int, repeat: int, dest: np.ndarray) -> dict[str, list[float]]:
    """Seconds per stream of ``nbytes``, received without a copy and into ``dest``."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    out: dict[str, list[float]] = {}
    try:
        for mode in ("no_copy", "into_buffer"):
            sender = _raw_proc(
                "zmq-send", f"tcp://127.0.0.1:{port}", str(nbytes), str(FRAME), str(repeat)
            )
            try:
                if sender.stdout is None or sender.stdin is None:
                    raise RuntimeError("no pipes to the raw sender")
                if sender.stdout.readline().strip() != "ready":
                    raise RuntimeError("raw pyzmq sender did not start")
                view = dest.data
                times = []
                for _ in range(repeat):
                    start = time.perf_counter()
                    sender.stdin.write("go\n")
                    sender.stdin.flush()
                    for off in range(0, nbytes, FRAME):
                        if mode == "no_copy":
                            sock.recv(copy=False)
                        else:
                            sock.recv_into(view[off : off + FRAME])
                    times.append(time.perf_counter() - start)
                out[mode] = times
                sender.stdin.write("end\n")
                sender.stdin.close()
                sender.wait(30)
            finally:
                procs.stop(sender, 5)
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


def raw_nixl(nbytes: int, repeat: int, dest: torch.Tensor) -> list[float]:
    """Seconds per READ of ``nbytes`` from another process's registered buffer."""
    from nixl._api import nixl_agent, nixl_agent_config

    target = _raw_proc("nixl-target", str(nbytes))
    try:
        if target.stdout is None:
            raise RuntimeError("no pipe to the NIXL target")
        line = target.stdout.readline()
        while line and not line.startswith("META "):  # NIXL logs to stdout too
            line = target.stdout.readline()
        meta_hex, addr = line.split()[1:]
        agent = nixl_agent("raw-reader", nixl_agent_config(backends=["UCX"]))
        agent.register_memory(dest)
        name = agent.add_remote_agent(bytes.fromhex(meta_hex))
        offs = np.arange(0, nbytes, FRAME, dtype=np.uint64)
        local = np.stack([dest.data_ptr() + offs, np.full_like(offs, FRAME), 0 * offs], 1)
        remote = np.stack([int(addr) + offs, np.full_like(offs, FRAME), 0 * offs], 1)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                name,
            )
            state = agent.transfer(handle)
            pause = 50e-6
            while state not in ("DONE", "ERR"):
                # Back off like the plane does: a busy poll starves UCX's progress thread.
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in {state}")
            times.append(time.perf_counter() - start)
        return times
    finally:
        if target.stdin is not None:
            target.stdin.close()
        procs.stop(target, 10)


def run(opts: Options) -> list[Figure]:
    """Start the two daemons, pull at two sizes per plane, measure the baselines."""
    from kvsidecar.peer.nixl_plane import nixl_available

    have_nixl = nixl_available()
    plane = "auto" if have_nixl else "zmq"
    blocks = opts.blocks
    block_bytes = 2 * opts.block_bytes  # K and V
    sizes = sorted({max(1, blocks // 4), blocks})
    note(
        f"peer: {opts.layers} layers x (2, {blocks}, {', '.join(map(str, opts.block_shape))}) "
        f"{opts.dtype}; pulls of {', '.join(str(s) for s in sizes)} blocks per layer; planes "
        f"zmq{' and nixl' if have_nixl else ' (NIXL not installed: no nixl figures)'}"
    )
    figures: list[Figure] = []
    endpoint = f"tcp://127.0.0.1:{_port()}"
    planes: list[Literal["zmq", "nixl"]] = ["zmq", "nixl"] if have_nixl else ["zmq"]
    progress = Progress(len(sizes) * (len(planes) + 1), "peer", enabled=opts.progress)
    with (
        # Loopback only, so without CURVE (`insecure`): CurveZMQ would encrypt the zmq plane's
        # data and compare it with an unencrypted raw stream.
        procs.daemon(peer_endpoint=endpoint, peer_data_plane=plane, insecure=True) as (prod_ep, _),
        # The consumer gets a peer endpoint too: without one it starts no NIXL agent.
        procs.daemon(
            peer_endpoint=f"tcp://127.0.0.1:{_port()}", peer_data_plane=plane, insecure=True
        ) as (cons_ep, _),
    ):
        shape = (2, blocks, *opts.block_shape)
        dtype = torch_dtype(opts.dtype)
        src = allocate_kv_caches(opts.layers, shape, dtype)
        dst = allocate_kv_caches(opts.layers, shape, dtype)
        for i, t in enumerate(src):
            # Distinct values per layer and position (int16 bit patterns, any is valid data).
            t.view(torch.int16).view(-1).copy_(
                torch.arange(t.view(torch.int16).numel(), dtype=torch.int32).to(torch.int16) + i
            )
        pc = SidecarClient(prod_ep, timeout_s=120, name="bench-producer")
        cc = SidecarClient(cons_ep, timeout_s=120, name="bench-consumer")
        try:
            pc.register_kv_caches({f"l{i}": t for i, t in enumerate(src)}, engine_id="p")
            cc.register_kv_caches({f"l{i}": t for i, t in enumerate(dst)}, engine_id="c")
            raw_dest = torch.ones(opts.layers * blocks * block_bytes, dtype=torch.uint8)
            for n in sizes:
                nbytes = n * block_bytes * opts.layers
                measured: dict[str, list[float]] = {}
                for name in planes:
                    progress.step(0, f"peer: {name} plane, {n} blocks")
                    measured[name] = _plane(
                        cc,
                        endpoint=endpoint,
                        plane=name,
                        blocks=n,
                        nbytes=nbytes,
                        repeat=opts.repeat,
                        src=src,
                        dst=dst,
                    )
                    progress.step()
                progress.step(0, f"peer: raw baselines, {n} blocks")
                raw = raw_zmq(nbytes, opts.repeat, raw_dest.numpy()[:nbytes])
                if have_nixl:
                    raw["nixl"] = raw_nixl(nbytes, opts.repeat, raw_dest[:nbytes])
                progress.step()
                figures += _figures(measured, raw, nbytes, have_nixl)
        finally:
            pc.close()
            cc.close()
            progress.close()
    if not figures:
        raise BenchUnavailable("no pull was measured")
    return figures


def _plane(
    cc: SidecarClient,
    *,
    endpoint: str,
    plane: Literal["zmq", "nixl"],
    blocks: int,
    nbytes: int,
    repeat: int,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
) -> list[float]:
    ids = list(range(blocks))

    def once() -> float:
        start = time.perf_counter()
        pulled = cc.pull("c", endpoint, "p", {"r": (ids, ids)}, plane=plane, timeout_s=300)
        took = time.perf_counter() - start
        if pulled.failed or pulled.nbytes != nbytes:
            raise RuntimeError(f"{plane} pull failed: {pulled}")
        return took

    for t in dst:
        t.zero_()
    once()  # warm-up (connections, registrations) and the correctness check
    for s, d in zip(src, dst, strict=True):
        if not torch.equal(s.view(torch.int16)[:, :blocks], d.view(torch.int16)[:, :blocks]):
            raise AssertionError(f"{plane} pull: the consumer's blocks differ from the producer's")
    return [once() for _ in range(repeat)]


def _figures(
    measured: dict[str, list[float]], raw: dict[str, list[float]], nbytes: int, nixl: bool
) -> list[Figure]:
    mib = nbytes / 2**20
    group = f"peer: pulls over loopback TCP, {mib:g} MiB"

    def gbps(times: list[float]) -> list[float]:
        return [nbytes / t / 1e9 for t in times]

    def fig(name: str, samples: list[float], base: str, base_samples: list[float]) -> Figure:
        return Figure(
            name=f"peer/{mib:g} MiB/{name}",
            unit="GB/s",
            samples=gbps(samples),
            baseline=base,
            baseline_samples=gbps(base_samples),
            group=group,
            chart="size",
            series=name,
            x=mib,
        )

    out = [
        fig("zmq plane pull", measured["zmq"], RAW_INTO, raw["into_buffer"]),
        fig("zmq plane pull", measured["zmq"], RAW_NO_COPY, raw["no_copy"]),
    ]
    if nixl:
        out.append(fig("nixl plane pull", measured["nixl"], RAW_NIXL, raw["nixl"]))
    return out

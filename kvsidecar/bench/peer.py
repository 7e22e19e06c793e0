"""``bench peer``: node-to-node pulls between two daemons against raw pyzmq and raw NIXL.

Two daemon processes on this host (a producer with a loopback peer endpoint, a consumer); this
process is the engine worker of both: ``layers`` tensors of ``(2, blocks, *block_shape)``
(kv_first, K and V) in shared memory per engine. Pulled: 1/64, 1/4 and all of the blocks of
every layer (16 MiB, 256 MiB and 1 GiB at the default sizes), contiguous ids; timed on the
client from sending the pull to its reply (handshake, reads and notifications included); the
bytes are checked once per plane and size. The ZMQ plane also pulls the same blocks in random
order into other random positions (a permutation on each side, so nothing but single blocks
coalesce): the block ids an engine's allocator hands out, for which the producer packs its
replies (docs/protocol.md).

The planes are measured in two phases, each with its own pair of daemons:

- **ZMQ plane**, daemons with ``peer_data_plane=zmq`` (no NIXL agent, whose UCX progress
  thread wakes every ``peer_nixl_wakeup_ms``, or busy-polls a core with 0). Baselines: a raw
  pyzmq PUSH -> PULL stream of the same bytes over loopback TCP in 1 MiB zero-copy frames
  received into a touched buffer with ``recv_into`` (what a transfer has to do), by a receiver
  with glibc's default settings, and by one with the daemon's (`kvsidecar.wire.zmq_memory`), so
  that the plane is compared like with like too. Each receiver is a process of its own with a
  connection that stays up.
- **NIXL plane**, daemons with ``peer_data_plane=nixl``. Baseline: what an expert writes with
  NIXL: one descriptor for the whole buffer on each side, prepared once, and one READ
  transfer per repetition on that prepared handle, polled with the plane's backoff; both of its
  agents' progress threads sleep between events, as the daemons' do (`new_agent`).

Within a phase, the methods take turns repetition by repetition, so they share the load.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import torch

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
RAW_KEEP = "raw pyzmq stream into a buffer, daemon's malloc settings"
RAW_NIXL = "raw NIXL READ, one prepared transfer"
SHUFFLED = "zmq plane pull, random ids"

Plane = Literal["zmq", "nixl"]


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


class RawZmq:
    """A raw receiver process (and its sender): `once` streams ``nbytes`` and returns seconds."""

    def __init__(self, nbytes: int, *, keep_freed_memory: bool) -> None:
        self.proc = _raw_proc("zmq-recv", str(nbytes), str(FRAME), str(int(keep_freed_memory)))
        if self.proc.stdout is None or self.proc.stdout.readline().strip() != "ready":
            procs.stop(self.proc, 5)
            raise RuntimeError("raw pyzmq receiver did not start")

    def once(self) -> float:
        """Seconds for one stream, as the receiver timed it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        """Stop the receiver (and with it its sender)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        procs.stop(self.proc, 10)


class RawNixl:
    """A NIXL target process and a reader agent here: one prepared READ of ``nbytes``."""

    def __init__(self, nbytes: int, dest: torch.Tensor) -> None:
        from nixl._api import nixl_agent_config

        from kvsidecar.peer.nixl_plane import new_agent

        self.target = _raw_proc("nixl-target", str(nbytes))
        try:
            if self.target.stdout is None:
                raise RuntimeError("no pipe to the NIXL target")
            line = self.target.stdout.readline()
            while line and not line.startswith("META "):  # NIXL logs to stdout too
                line = self.target.stdout.readline()
            meta_hex, addr = line.split()[1:]
            # A progress thread that sleeps between events, as the daemons' (`new_agent`).
            agent = new_agent("raw-reader", nixl_agent_config(backends=["UCX"]))
            agent.register_memory(dest)
            name = agent.add_remote_agent(bytes.fromhex(meta_hex))
            # One descriptor per side for the whole buffer, prepared once; the handle is
            # posted again for every repetition.
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dest.data_ptr(), nbytes, 0)], "DRAM")
            remote = agent.prep_xfer_dlist(name, [(int(addr), nbytes, 0)], "DRAM")
            self.handle = agent.make_prepped_xfer("READ", local, [0], remote, [0])
            self.agent, self.dlists = agent, (local, remote)
        except BaseException:
            self._stop_target()
            raise

    def once(self) -> float:
        """Seconds for one READ, polled like the plane polls (a backoff up to 1 ms)."""
        start = time.perf_counter()
        state = self.agent.transfer(self.handle)
        pause = 50e-6
        while state not in ("DONE", "ERR"):
            # A busy poll would starve UCX's progress thread on a small machine.
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            state = self.agent.check_xfer_state(self.handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in {state}")
        return time.perf_counter() - start

    def close(self) -> None:
        """Release the handle and lists, stop the target."""
        with contextlib.suppress(Exception):
            self.agent.release_xfer_handle(self.handle)
            for dlist in self.dlists:
                self.agent.release_dlist_handle(dlist)
        self._stop_target()

    def _stop_target(self) -> None:
        if self.target.stdin is not None:
            with contextlib.suppress(OSError):
                self.target.stdin.close()
        procs.stop(self.target, 10)


class _Setup:
    """The workload: source and destination caches, the pull sizes (blocks per layer)."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        blocks = opts.blocks
        self.sizes = sorted({max(1, blocks // 64), max(1, blocks // 4), blocks})
        shape = (2, blocks, *opts.block_shape)
        dtype = torch_dtype(opts.dtype)
        self.src = allocate_kv_caches(opts.layers, shape, dtype)
        self.dst = allocate_kv_caches(opts.layers, shape, dtype)
        for i, t in enumerate(self.src):
            # Distinct values per layer and position (int16 bit patterns, any is valid data).
            t.view(torch.int16).view(-1).copy_(
                torch.arange(t.view(torch.int16).numel(), dtype=torch.int32).to(torch.int16) + i
            )

    def nbytes(self, blocks: int) -> int:
        """Bytes one pull of ``blocks`` per layer carries."""
        return blocks * 2 * self.opts.block_bytes * self.opts.layers


@contextlib.contextmanager
def _daemons(setup: _Setup, plane: Plane) -> Iterator[tuple[SidecarClient, SidecarClient, str]]:
    """Start producer and consumer daemons, register both engines.

    Yields (producer's client, consumer's client, the producer's peer endpoint).
    """
    endpoint = f"tcp://127.0.0.1:{_port()}"
    # Loopback only, so without CURVE (`insecure`): CurveZMQ would encrypt the zmq plane's data
    # and compare it with an unencrypted raw stream. Two daemons of one user on one host: NIXL,
    # which lets each read all of the other's memory, is allowed (`peer_nixl_trusted`).
    trust: dict[str, Any] = {"peer_nixl_trusted": True} if plane == "nixl" else {}
    with (
        procs.daemon(peer_endpoint=endpoint, peer_data_plane=plane, insecure=True, **trust) as (
            pep,
            _,
        ),
        # The consumer gets a peer endpoint too: without one it starts no NIXL agent.
        procs.daemon(
            peer_endpoint=f"tcp://127.0.0.1:{_port()}",
            peer_data_plane=plane,
            insecure=True,
            **trust,
        ) as (cep, _),
        SidecarClient(pep, timeout_s=120, name="bench-producer") as pc,
        SidecarClient(cep, timeout_s=120, name="bench-consumer") as cc,
    ):
        pc.register_kv_caches({f"l{i}": t for i, t in enumerate(setup.src)}, engine_id="p")
        cc.register_kv_caches({f"l{i}": t for i, t in enumerate(setup.dst)}, engine_id="c")
        yield pc, cc, endpoint


def _puller(
    clients: tuple[SidecarClient, SidecarClient],
    endpoint: str,
    plane: Plane,
    setup: _Setup,
    blocks: int,
    *,
    shuffled: bool = False,
) -> Any:
    """Check one pull's bytes (the warm-up), then return a timed pull of ``blocks``.

    Each pull reads a request of its own, published by the producer before the clock starts: a
    producer opens blocks only to reads of a published request, and releases it once read.
    ``shuffled``: the blocks in a random order on each side (module doc).
    """
    pc, cc = clients
    remote, local = list(range(blocks)), list(range(blocks))
    if shuffled:
        rng = np.random.default_rng(blocks)
        remote, local = rng.permutation(blocks).tolist(), rng.permutation(blocks).tolist()
    nbytes = setup.nbytes(blocks)
    serial = itertools.count()

    def once() -> float:
        rid = f"{plane}-{blocks}-{'shuffled-' if shuffled else ''}{next(serial)}"
        pc.publish("p", rid, remote)
        start = time.perf_counter()
        pulled = cc.pull(
            "c",
            endpoint,
            "p",
            {"r": (remote, local)},
            remote_request_ids={"r": rid},
            plane=plane,
            timeout_s=300,
        )
        took = time.perf_counter() - start
        if pulled.failed or pulled.nbytes != nbytes:
            raise RuntimeError(f"{plane} pull failed: {pulled}")
        return took

    for t in setup.dst:
        t.zero_()
    once()  # warm-up (connections, registrations) and the correctness check
    for s, d in zip(setup.src, setup.dst, strict=True):
        if not torch.equal(s.view(torch.int16)[:, remote], d.view(torch.int16)[:, local]):
            raise AssertionError(f"{plane} pull: the consumer's blocks differ from the producer's")
    return once


def _turns(methods: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            out[name].append(fn())
    return out


def _zmq_phase(setup: _Setup, progress: Progress) -> list[Figure]:
    figures = []
    with _daemons(setup, "zmq") as (pc, cc, endpoint):
        for blocks in setup.sizes:
            nbytes = setup.nbytes(blocks)
            progress.step(0, f"peer: zmq plane, {blocks} blocks")
            pull = _puller((pc, cc), endpoint, "zmq", setup, blocks)
            shuffled = _puller((pc, cc), endpoint, "zmq", setup, blocks, shuffled=True)
            plain = RawZmq(nbytes, keep_freed_memory=False)
            kept = RawZmq(nbytes, keep_freed_memory=True)
            try:
                plain.once(), kept.once()  # warm: the connections' buffers grow on first use
                got = _turns(
                    {
                        "plane": pull,
                        "shuffled": shuffled,
                        RAW_INTO: plain.once,
                        RAW_KEEP: kept.once,
                    },
                    setup.opts.repeat,
                )
            finally:
                plain.close()
                kept.close()
            figures += [
                _figure(nbytes, name, got[key], base, got[base])
                for key, name in (("plane", "zmq plane pull"), ("shuffled", SHUFFLED))
                for base in (RAW_INTO, RAW_KEEP)
            ]
            progress.step()
    return figures


def _nixl_phase(setup: _Setup, progress: Progress) -> list[Figure]:
    figures = []
    raw_dest = torch.ones(setup.nbytes(setup.opts.blocks), dtype=torch.uint8)
    with _daemons(setup, "nixl") as (pc, cc, endpoint):
        for blocks in setup.sizes:
            nbytes = setup.nbytes(blocks)
            progress.step(0, f"peer: nixl plane, {blocks} blocks")
            pull = _puller((pc, cc), endpoint, "nixl", setup, blocks)
            raw = RawNixl(nbytes, raw_dest[:nbytes])
            try:
                raw.once()  # warm: connection and registration caches
                got = _turns({"plane": pull, RAW_NIXL: raw.once}, setup.opts.repeat)
            finally:
                raw.close()
            figures.append(
                _figure(nbytes, "nixl plane pull", got["plane"], RAW_NIXL, got[RAW_NIXL])
            )
            progress.step()
    return figures


def run(opts: Options) -> list[Figure]:
    """Measure both planes (NIXL where installed), each against its raw baselines."""
    from kvsidecar.peer.nixl_plane import nixl_available

    have_nixl = nixl_available()
    setup = _Setup(opts)
    note(
        f"peer: {opts.layers} layers x (2, {opts.blocks}, "
        f"{', '.join(map(str, opts.block_shape))}) {opts.dtype}; pulls of "
        f"{', '.join(str(s) for s in setup.sizes)} blocks per layer; planes "
        f"zmq{' and nixl' if have_nixl else ' (NIXL not installed: no nixl figures)'}"
    )
    progress = Progress(len(setup.sizes) * (2 if have_nixl else 1), "peer", enabled=opts.progress)
    try:
        figures = _zmq_phase(setup, progress)
        if have_nixl:
            figures += _nixl_phase(setup, progress)
    finally:
        progress.close()
    if not figures:
        raise BenchUnavailable("no pull was measured")
    return figures


def _figure(
    nbytes: int, name: str, samples: list[float], base: str, base_samples: list[float]
) -> Figure:
    mib = nbytes / 2**20

    def gbps(times: list[float]) -> list[float]:
        return [nbytes / t / 1e9 for t in times]

    return Figure(
        name=f"peer/{mib:g} MiB/{name}",
        unit="GB/s",
        samples=gbps(samples),
        baseline=base,
        baseline_samples=gbps(base_samples),
        group=f"peer: pulls over loopback TCP, {mib:g} MiB",
        chart="size",
        series=name,
        x=mib,
    )

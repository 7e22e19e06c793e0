"""The copy executor's ordering and cancellation rules (kvsidecar/executor.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kvsidecar.node.executor import CopyExecutor

IDS = np.array([1, 2], dtype=np.int64)


async def test_conflicting_jobs_apply_in_arrival_order() -> None:
    ex = CopyExecutor(2)
    order: list[int] = []
    gate = threading.Event()
    try:
        first = ex.submit(lambda: (gate.wait(5), order.append(1))[1], reads={}, writes={"b": IDS})
        second = ex.submit(lambda: order.append(2), reads={}, writes={"b": IDS})
        other = ex.submit(lambda: order.append(3), reads={}, writes={"c": IDS})
        await other  # disjoint blocks: runs while the first one is held
        assert order == [3] and ex.in_flight == 2
        gate.set()
        await asyncio.gather(first, second)
        assert order == [3, 1, 2] and ex.in_flight == 0
    finally:
        gate.set()
        ex.shutdown(wait=True)


async def test_cancelled_while_waiting_never_runs() -> None:
    ex = CopyExecutor(1)
    ran: list[int] = []
    gate = threading.Event()
    try:
        first = ex.submit(lambda: gate.wait(5), reads={}, writes={"b": IDS})
        waiting = ex.submit(lambda: ran.append(1), reads={}, writes={"b": IDS})
        waiting.cancel()
        await asyncio.sleep(0)
        assert ex.in_flight == 1  # dropped at once: later jobs need not wait for it
        gate.set()
        await first
        await asyncio.sleep(0.05)
        assert ran == [] and ex.in_flight == 0
    finally:
        gate.set()
        ex.shutdown(wait=True)


async def test_cancelled_while_running_stays_in_flight_until_done() -> None:
    """A job that waited, started, then was cancelled still counts until its thread ends."""
    ex = CopyExecutor(1)
    first_gate, second_gate = threading.Event(), threading.Event()
    started = threading.Event()
    try:
        first = ex.submit(lambda: first_gate.wait(5), reads={}, writes={"b": IDS})

        def second_job() -> None:
            started.set()
            second_gate.wait(5)

        second = ex.submit(second_job, reads={}, writes={"b": IDS})
        first_gate.set()
        await first
        await asyncio.to_thread(started.wait, 5)
        second.cancel()
        await asyncio.sleep(0.05)
        assert ex.in_flight == 1
        idle: list[bool] = []
        ex.when_idle({"b"}, lambda: idle.append(True))
        assert idle == []
        third = ex.submit(lambda: 3, reads={}, writes={"b": IDS})
        await asyncio.sleep(0.05)
        assert not third.done()  # it may not overtake the cancelled, still running copy
        second_gate.set()
        assert await third == 3
        assert idle == [True] and ex.in_flight == 0
    finally:
        first_gate.set()
        second_gate.set()
        ex.shutdown(wait=True)


async def test_failure_reaches_the_caller() -> None:
    ex = CopyExecutor(1)

    def boom() -> None:
        raise ValueError("copy failed")

    try:
        with pytest.raises(ValueError, match="copy failed"):
            await ex.submit(boom, reads={}, writes={"b": IDS})
        assert ex.in_flight == 0
    finally:
        ex.shutdown(wait=True)


async def test_free_only_when_no_job_in_flight_conflicts() -> None:
    """`free`: a short job may run on the loop only on blocks no job in flight shares."""
    ex = CopyExecutor(1)
    gate = threading.Event()
    try:
        assert ex.free(reads={}, writes={"b": IDS})  # idle
        held = ex.submit(lambda: gate.wait(5), reads={"a": IDS}, writes={"b": IDS})
        assert not ex.free(reads={}, writes={"b": IDS[:1]})  # write after write
        assert not ex.free(reads={"b": IDS[1:]}, writes={})  # read after write
        assert not ex.free(reads={}, writes={"a": IDS})  # write after read
        assert ex.free(reads={"a": IDS}, writes={"c": IDS})  # reads share, writes do not
        assert ex.free(reads={}, writes={"b": np.array([7], dtype=np.int64)})  # other blocks
        gate.set()
        await held
        assert ex.free(reads={}, writes={"b": IDS})
    finally:
        gate.set()
        ex.shutdown(wait=True)
    assert not ex.free(reads={}, writes={"z": IDS})  # shut down: nothing runs any more

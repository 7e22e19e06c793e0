"""Worker processes for tests: ``python -m tests.procs.<module>`` children driven by lines.

The one place that starts such children and stops them. A child's output is read by a thread into
a queue (`LineReader`), so every wait for a line has a deadline and no line is missed; at the end
a child is asked to exit (its exit line, then end of input), killed if it does not in time, and
its pipes are closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

import numpy as np

from tests.support import ROOT, python_env


class LineReader:
    """The lines of a text pipe, read by a thread into a queue, for waits with a deadline.

    Not `select` on the pipe before `readline`: the file object reads ahead, so a line already in
    its buffer leaves the descriptor quiet (the wait gives up on a line that is there), and a
    `readline` after half a line blocks past any deadline.
    """

    def __init__(self, stream: IO[str], name: str) -> None:
        self.name = name
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._pump, args=(stream,), name=f"lines of {name}", daemon=True
        )
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self._queue.put(line.strip())
        except (OSError, ValueError):  # the pipe was closed under the thread
            pass
        finally:
            self._queue.put(None)

    def get(self, timeout: float) -> str:
        """The next line (stripped); TimeoutError after ``timeout`` s, EOFError at the end."""
        try:
            line = self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise TimeoutError(f"{self.name} silent for {timeout:.0f} s") from None
        if line is None:
            self._queue.put(None)  # the end stays the end for later calls
            raise EOFError(f"{self.name} closed its output")
        return line

    def available(self) -> list[str]:
        """Every line read so far and not yet taken, without waiting."""
        lines: list[str] = []
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return lines
            if line is None:
                self._queue.put(None)
                return lines
            lines.append(line)

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the thread, which ends at the pipe's end."""
        self._thread.join(timeout)


class LineChild:
    """A ``tests.procs.<module>`` child process, driven by text lines on stdin and stdout."""

    ready_line = "ready"
    """What the child prints once it is ready (see `wait_ready`)."""

    def __init__(
        self,
        module: str,
        *args: str,
        name: str = "",
        exit_line: str = "exit",
        python: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stderr: Any = None,
    ) -> None:
        """``python``: another interpreter (its own venv); ``env``: added variables. With
        ``python`` the child leads a process group of its own, and `stop` ends the whole group
        (such children start processes of their own: vLLM does)."""
        self.name = name or module
        self.exit_line = exit_line
        self._group = python is not None
        self.proc = subprocess.Popen(
            [str(python or sys.executable), "-m", f"tests.procs.{module}", *args],
            cwd=ROOT,
            env=python_env(**(env or {})),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=self._group,
        )
        assert self.proc.stdout is not None
        self._reader = LineReader(self.proc.stdout, self.name)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def line(self, timeout: float = 30.0) -> str:
        """The child's next output line (stripped); TimeoutError if it stays silent."""
        try:
            return self._reader.get(timeout)
        except EOFError:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait(5)}") from None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait for `ready_line`.

        Generous: ten processes importing torch at once on two busy cores take a while.
        """
        said = self.line(timeout)
        if said != self.ready_line:
            raise RuntimeError(f"{self.name} said {said!r} instead of {self.ready_line!r}")

    def send_line(self, text: str) -> None:
        """Write one command line to the child."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def ask(self, text: str, timeout: float = 30.0) -> str:
        """Send one command line and return the child's answer line."""
        self.send_line(text)
        return self.line(timeout)

    def ask_exit(self) -> None:
        """Ask the child to exit without waiting: its exit line, then end of input."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):  # a child gone meanwhile is fine
                self.send_line(self.exit_line)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask it to exit, kill it if it does not in ``timeout`` s, close the pipes."""
        self.ask_exit()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(5)  # it ends at the pipe's end; the pipe is closed after it
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
        if self._group:  # what it started and left behind
            self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (a child started with ``python``)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def __enter__(self) -> LineChild:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


C = TypeVar("C", bound=LineChild)


@contextlib.contextmanager
def all_ready(children: Sequence[C], timeout: float = 120.0) -> Iterator[list[C]]:
    """Wait until every child is ready; at the end stop them all, whatever happened."""
    try:
        for child in children:
            child.wait_ready(timeout)
        yield list(children)
    finally:
        # Ask all to exit first, then wait: stopping them one by one costs a second each.
        for child in children:
            child.ask_exit()
        for child in children:
            child.stop()


class WorkerProcess(LineChild):
    """A ``tests.procs.kv_worker`` child: registers KV caches, dumps them on request."""

    def __init__(self, spec: dict[str, Any], module: str = "kv_worker") -> None:
        super().__init__(module, json.dumps(spec), name=f"worker {spec.get('engine', module)}")
        self.spec = spec

    def dump(self, directory: Path, timeout: float = 30.0) -> list[np.ndarray]:
        """Each layer's logical (2, B, N, H, C) values as they are now."""
        self._ask_dump(directory, timeout)
        return [np.load(directory / f"layer{i}.npy") for i in range(self.spec["layers"])]

    def _ask_dump(self, directory: Path, timeout: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        assert self.ask(f"dump {directory}", timeout) == "ok"


def workers(specs: list[dict[str, Any]]) -> contextlib.AbstractContextManager[list[WorkerProcess]]:
    """Start every kv worker at once (separate processes), wait until all registered, stop all."""
    return all_ready([WorkerProcess(s) for s in specs])


class PeerWorkers(WorkerProcess):
    """A ``tests.procs.peer_worker`` process (several engines and ranks in one process)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(spec, module="peer_worker")

    def dump_all(self, directory: Path, timeout: float = 60.0) -> dict[str, np.ndarray]:
        """Every engine/rank/layer's logical values, keyed ``<engine>.r<rank>.l<layer>``."""
        self._ask_dump(directory, timeout)
        return {p.stem: np.load(p) for p in directory.glob("*.npy")}

    def refill(self, timeout: float = 60.0) -> None:
        """Put every rank's memory back to its initial values (what the spec's seeds give)."""
        assert self.ask("fill", timeout) == "ok"


@contextlib.contextmanager
def peer_workers(spec: dict[str, Any]) -> Iterator[PeerWorkers]:
    """Start a peer worker process, wait until it registered everything, always stop it."""
    with all_ready([PeerWorkers(spec)]) as (w,):
        yield w


class ReportWorker(LineChild):
    """A ``tests.procs.report_worker`` child that answers one JSON line per command."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__(
            "report_worker",
            json.dumps(spec),
            name=f"report worker r{spec.get('tp_rank')}",
            exit_line=json.dumps({"exit": True}),
        )

    def send(self, cmd: dict[str, Any]) -> None:
        """Send one command without waiting for its answer."""
        self.send_line(json.dumps(cmd))

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command and return its answer."""
        self.send(cmd)
        result: dict[str, Any] = json.loads(self.line())
        return result


class FaultWorker(LineChild):
    """A ``tests.procs.fault_worker`` child: it moves blocks until told to exit, and prints one
    JSON line per outcome, which `lines` collects."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__("fault_worker", json.dumps(spec), name=f"fault worker {spec['engine']}")
        self._records: list[dict[str, Any]] = []

    @property
    def lines(self) -> list[dict[str, Any]]:
        """Every JSON line the child printed so far."""
        new = self._reader.available()
        self._records.extend(json.loads(line) for line in new if line.startswith("{"))
        return self._records

    def outcomes(self) -> list[dict[str, Any]]:
        """The lines that report one move each (``{"i": n, ...}``)."""
        return [x for x in self.lines if "i" in x]

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``pred`` until true; TimeoutError naming ``what`` (and the last lines) otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{what} within {timeout} s; last lines {self.lines[-5:]}")

    def stop(self, timeout: float = 20.0) -> None:
        """Stop it (a busy worker may need a while to finish its current move)."""
        super().stop(timeout)

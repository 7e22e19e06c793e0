"""How a process that loaded NIXL's native libraries ends: `finish_process`.

The libraries the NIXL wheel bundles crash in their exit handlers. UCX's InfiniBand module
(``libuct_ib_efa``) links the system's ``libefa``, which brings the system's libibverbs and
libnl-route next to the copies the wheel bundles; at ``exit`` the destructors of one libnl-route
run into the other's symbols (SIGSEGV in ``rtnl_tc_unregister``, called from ``_dl_fini``),
whatever was done with the agent and in whatever order it was shut down: deleting the agent
first does not help. A daemon that drained cleanly would then be reported crashed (systemd marks
the unit failed, Kubernetes counts a restart).

So a process whose NIXL agent was made (`note_native_libraries`, called before the first one is
built) ends, once its main part has returned (the daemon shut down: sockets closed, runtime files
removed), with its logs and standard streams flushed, by ``os._exit``, which runs no exit
handler. A process that never made an agent exits as usual. Light on purpose: the CLI imports it
before anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable

_loaded: list[bool] = []
"""Not empty once this process has tried to make a NIXL agent."""


def note_native_libraries() -> None:
    """Record that this process loads NIXL's native plugins (called before an agent is made)."""
    _loaded[:] = [True]


def native_libraries_loaded() -> bool:
    """Whether this process has tried to make a NIXL agent."""
    return bool(_loaded)


def finish_process(main: Callable[[], int]) -> int:
    """Run a process's ``main`` and return its exit code, or leave the process with it.

    It leaves, without running exit handlers (see the module), if a NIXL agent was made. A
    `SystemExit` or an exception from ``main`` ends such a process as Python would have ended
    it (its message or traceback on stderr; the code it carries, or 1). Logging handlers and the
    standard streams are flushed first.
    """
    try:
        code = main()
    except SystemExit as exc:
        if not _loaded:
            raise
        code = _exit_code(exc)
    except Exception:
        if not _loaded:
            raise
        traceback.print_exc()
        code = 1
    if _loaded:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def _exit_code(exc: SystemExit) -> int:
    """Return the exit code Python gives a `SystemExit` (printing its message, if it has one)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1

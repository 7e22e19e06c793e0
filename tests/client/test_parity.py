"""The blocking and the asyncio client offer the same methods, with the same parameters.

Both are written by hand over the same request builders (`kvsidecar.client.requests`); this is
what keeps them in step. A public method or property of one has its twin in the other, with the
same parameter names, kinds, defaults and annotations, and the same result (awaited, on the
asyncio side). What differs by nature is listed below, and the lists are checked to stay true.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvsidecar.client import AsyncSidecarClient, SidecarClient

BLOCKING_ONLY = {
    "__enter__": "a `with` block; the asyncio client is an `async with`",
    "__exit__": "a `with` block",
    "submit_cache_lookup": "a submitted call (`Pending`); an asyncio caller starts a task",
    "submit_cache_store": "a submitted call: the blocking client only submits stores",
    "submit_cache_load": "a submitted call: the blocking client only submits loads",
    "submit_pull": "a submitted call (`Pending`)",
    "submit_publish": "a submitted call (`Pending`)",
    "submit_take_worker_events": "a submitted call (`Pending`)",
}
ASYNC_ONLY = {
    "__aenter__": "an `async with` block",
    "__aexit__": "an `async with` block",
    "start": "connects and says hello; the blocking client does that in its constructor",
    "cache_store": "awaited; the blocking client's is `submit_cache_store`",
    "cache_load": "awaited; the blocking client's is `submit_cache_load`",
}
ANNOTATIONS_DIFFER = {
    ("__init__", "context"): "a `zmq.Context` for blocking sockets, a `zmq.asyncio.Context`",
}
SUBMIT_OMITS = {
    "submit_pull": {"pp_rank", "medium"},  # a connector's pull: every rank's device memory
}
NOT_AWAITED = {"__init__"}
"""Methods of the asyncio client that are plain functions, as on the blocking one."""


def _public(cls: type) -> dict[str, Any]:
    """The class's public methods and properties, and the dunders it defines, by name."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # `object` left out; subclasses win
        for name, value in vars(klass).items():
            dunder = name.startswith("__") and name.endswith("__")
            if (not name.startswith("_") or dunder) and (callable(value) or _is_property(value)):
                members[name] = value
    return members


def _is_property(value: Any) -> bool:
    return isinstance(value, property)


def _parameters(fn: Any) -> list[tuple[str, Any, Any, Any]]:
    """Each parameter's name, kind, default and annotation (as written: a string)."""
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


def _compare(name: str, blocking: Any, asyncio: Any) -> list[str]:
    """Differences between one member of the blocking client and its asyncio twin."""
    if _is_property(blocking) or _is_property(asyncio):
        if not (_is_property(blocking) and _is_property(asyncio)):
            return [f"{name}: a property on one client only"]
        problems = []
        if (blocking.fset is None) != (asyncio.fset is None):
            problems.append(f"{name}: settable on one client only")
        returns = (
            inspect.signature(blocking.fget).return_annotation,
            inspect.signature(asyncio.fget).return_annotation,
        )
        if returns[0] != returns[1]:
            problems.append(f"{name}: {returns[0]} against {returns[1]}")
        return problems
    problems = []
    if inspect.iscoroutinefunction(blocking):
        problems.append(f"{name}: a coroutine on the blocking client")
    if inspect.iscoroutinefunction(asyncio) == (name in NOT_AWAITED):
        problems.append(f"{name}: {'a' if name in NOT_AWAITED else 'not a'} coroutine on asyncio")
    ours, theirs = _parameters(blocking), _parameters(asyncio)
    if [p[:3] for p in ours] != [p[:3] for p in theirs]:
        problems.append(
            f"{name}: {inspect.signature(blocking)} against {inspect.signature(asyncio)}"
        )
    for (param, _, _, a), (_, _, _, b) in zip(ours, theirs, strict=False):
        if a != b and (name, param) not in ANNOTATIONS_DIFFER:
            problems.append(f"{name}({param}): {a} against {b}")
    returns = inspect.signature(blocking).return_annotation
    awaited = inspect.signature(asyncio).return_annotation
    if returns != awaited:
        problems.append(f"{name}: returns {returns} against {awaited}")
    return problems


def _differences(blocking_cls: type, asyncio_cls: type) -> list[str]:
    """Every way the two clients differ that is not listed above as a difference by nature."""
    blocking, asyncio = _public(blocking_cls), _public(asyncio_cls)
    problems = [
        f"{name}: only on {side}"
        for side, names in (
            (blocking_cls.__name__, set(blocking) - set(asyncio) - set(BLOCKING_ONLY)),
            (asyncio_cls.__name__, set(asyncio) - set(blocking) - set(ASYNC_ONLY)),
        )
        for name in sorted(names)
    ]
    for name in sorted(set(blocking) & set(asyncio)):
        problems += _compare(name, blocking[name], asyncio[name])
    return problems


def test_the_blocking_and_the_asyncio_client_have_the_same_methods() -> None:
    problems = _differences(SidecarClient, AsyncSidecarClient)
    assert not problems, "\n".join(problems)


def test_the_listed_differences_are_still_true() -> None:
    """A difference listed above that no longer exists is taken off the list, not kept."""
    blocking, asyncio = _public(SidecarClient), _public(AsyncSidecarClient)
    assert {n for n in BLOCKING_ONLY if n not in blocking or n in asyncio} == set()
    assert {n for n in ASYNC_ONLY if n not in asyncio or n in blocking} == set()
    for name, param in ANNOTATIONS_DIFFER:
        a = inspect.signature(blocking[name]).parameters[param].annotation
        b = inspect.signature(asyncio[name]).parameters[param].annotation
        assert a != b, (name, param)


def test_a_submitted_call_takes_what_its_awaited_twin_takes() -> None:
    """``submit_x`` of the blocking client is ``x`` of the asyncio one, returning a `Pending`."""
    blocking, asyncio = _public(SidecarClient), _public(AsyncSidecarClient)
    submits = [name for name in blocking if name.startswith("submit_")]
    assert submits, "no submitted calls found"
    for name in submits:
        twin = asyncio[name.removeprefix("submit_")]
        omitted = SUBMIT_OMITS.get(name, set())
        ours = _parameters(blocking[name])
        theirs = [p for p in _parameters(twin) if p[0] not in omitted]
        assert ours == theirs, name
        returns = inspect.signature(twin).return_annotation
        assert inspect.signature(blocking[name]).return_annotation == f"Pending[{returns}]", name


class _Blocking:
    def __init__(self, endpoint: str | None = None) -> None: ...

    def move(self, src: int, *, timeout: float | None = None) -> int:
        return src

    def status(self) -> str:
        return ""

    def forgotten(self) -> None: ...

    @property
    def worker(self) -> int:
        return 0


class _Asyncio:
    def __init__(self, endpoint: str | None = None) -> None: ...

    async def move(self, src: int, *, timeout: float | None = 1.0, layers: int = 0) -> int:
        return src

    def status(self) -> str:
        return ""

    @property
    def worker(self) -> str:
        return ""


def test_the_comparison_sees_each_kind_of_difference() -> None:
    """A comparison that finds nothing passes every pair of clients: this one finds each."""
    problems = _differences(_Blocking, _Asyncio)
    assert [p.split(":")[0] for p in problems] == [
        "forgotten",  # a method on one side only
        "move",  # a default changed, a parameter added
        "status",  # not awaited on the asyncio side
        "worker",  # a property's type
    ], problems
    assert _differences(_Blocking, _Blocking) == [
        f"{name}: not a coroutine on asyncio" for name in ("forgotten", "move", "status")
    ]

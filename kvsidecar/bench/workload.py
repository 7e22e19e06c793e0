"""The block-move workload: id sets, caches, block marks to check a copy, and the baselines.

A cache is ``layers`` K-or-V tensors of ``(num_blocks, *block_shape)``. Each block's first two
int16s carry (block id, layer) so a copy can be checked without comparing every byte.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from kvsidecar.core import copier, mover

IdPair = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]


def make_ids(kind: str, count: int, num_blocks: int, run: int, rng: np.random.Generator) -> IdPair:
    """Source and destination ids: ``random`` distinct ids, or ``runs`` of ``run`` consecutive ids.

    Runs start at multiples of ``run`` on both sides, chosen at random, so they never overlap.
    """
    if kind == "random" or run <= 1:
        return (
            rng.choice(num_blocks, count, replace=False).astype(np.int64),
            rng.choice(num_blocks, count, replace=False).astype(np.int64),
        )
    runs = -(-count // run)
    if runs > num_blocks // run:
        raise ValueError(f"{count} blocks in runs of {run} do not fit in {num_blocks} blocks")

    def side() -> npt.NDArray[np.int64]:
        starts = rng.choice(num_blocks // run, runs, replace=False) * run
        return (starts[:, None] + np.arange(run)).ravel()[:count].astype(np.int64)

    return side(), side()


def id_sets(
    count: int, num_blocks: int, run_lengths: tuple[int, ...], seed: int
) -> dict[str, IdPair]:
    """``random`` and one ``runsN`` set per run length (those that fit), from one seed."""
    rng = np.random.default_rng(seed)
    sets = {"random": make_ids("random", count, num_blocks, 1, rng)}
    for run in run_lengths:
        if 1 < run <= count and -(-count // run) <= num_blocks // run:
            sets[f"runs{run}"] = make_ids("runs", count, num_blocks, run, rng)
    return sets


def run_length_of(name: str) -> int:
    """Return the run length an id-set name stands for (``random`` is 1)."""
    return 1 if name == "random" else int(name.removeprefix("runs"))


def _marks(view: torch.Tensor) -> torch.Tensor:
    return view.view(torch.int16).reshape(view.shape[0], -1)


def mark_blocks(views: list[torch.Tensor]) -> None:
    """Write (block, layer) into each block's first two int16s, to check a copy afterwards."""
    for layer, view in enumerate(views):
        flat = _marks(view)
        flat[:, 0] = torch.arange(view.shape[0], dtype=torch.int32).to(torch.int16)
        flat[:, 1] = layer


def reset_marks(views: list[torch.Tensor]) -> None:
    """Overwrite every block's marks, so a copy that did nothing cannot pass the check."""
    for view in views:
        _marks(view)[:, :2] = -1


def check_blocks(
    dst: list[torch.Tensor], src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]
) -> None:
    """Raise unless block ``src_ids[i]`` of every layer arrived at ``dst_ids[i]`` of that layer."""
    d_idx = torch.from_numpy(np.ascontiguousarray(dst_ids, dtype=np.int64))
    want = torch.from_numpy(src_ids.astype(np.int64)).to(torch.int16)
    for layer, view in enumerate(dst):
        got = _marks(view).index_select(0, d_idx.to(view.device))[:, :2].cpu()
        if not (torch.equal(got[:, 0], want) and bool((got[:, 1] == layer).all())):
            raise AssertionError(f"layer {layer}: blocks did not arrive where they should")


def allocate(
    layers: int, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, region: bool
) -> list[torch.Tensor]:
    """Private caches, every page touched now: one region (layers stack) or separate tensors."""
    shape = (num_blocks, *block_shape)
    if region:
        whole = torch.zeros((layers, *shape), dtype=dtype)
        return list(whole.unbind(0))
    return [torch.zeros(shape, dtype=dtype) for _ in range(layers)]


def naive_copy(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    s_idx: torch.Tensor,
    d_idx: torch.Tensor,
    threads: int,
) -> Callable[[], None]:
    """Return the copy an engine writes without a mover: per layer ``index_copy_(index_select)``.

    At a given torch thread count (on a busy machine torch's default count can be the slower).
    """

    def go() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for s_t, d_t in zip(src, dst, strict=True):
                d_t.index_copy_(0, d_idx, s_t.index_select(0, s_idx))
        finally:
            torch.set_num_threads(before)

    return go


def run_copy(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    s_ids: npt.NDArray[np.int64],
    d_ids: npt.NDArray[np.int64],
    threads: int | None = None,
) -> Callable[[], None]:
    """Return the in-process coalesced copy: ``validate_move`` + ``plan_runs`` + ``copy_runs``.

    The ids go in as little-endian int32 frames, as they arrive from ZeroMQ.
    """
    s32, d32 = s_ids.astype("<i4"), d_ids.astype("<i4")
    src_n, dst_n = src[0].shape[0], dst[0].shape[0]

    def go() -> None:
        mover.validate_move(s32, d32, src_num_blocks=src_n, dst_num_blocks=dst_n)
        copier.copy_runs(src, dst, mover.plan_runs(s32, d32), threads=threads)

    return go


def memcpy(nbytes: int) -> Callable[[], None]:
    """Return the machine's limit: ``np.copyto`` of ``nbytes`` between touched buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)

    def go() -> None:
        np.copyto(dst, src)

    return go

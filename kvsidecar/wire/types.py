"""The value types messages are made of: buffer descriptors, worker and buffer references, handles.

Shared by the daemon, the client and the memory handles (`kvsidecar.memory` opens these
handles). Schema evolution follows msgspec's rules, as in `kvsidecar.wire.protocol`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

Arrangement = Literal[
    "kv_first", "blocks_first", "split", "mla", "vllm_cpu", "vllm_cpu_amx", "kv_cells"
]
"""How K and V sit in one registered tensor.

- ``kv_first``: ``(2, B, N, H, C)`` (FlashAttention)
- ``blocks_first``: ``(B, 2, N, H, C)`` (FlashInfer)
- ``split``: ``(B, N, H, C)``, one tensor for K and another for V
- ``mla``: ``(B, N, C)``, one latent vector per token
- ``vllm_cpu``: ``(B, H, N, 2C)``, vLLM's CPU attention cache (its ``vec`` kernels): per block
  and head, K stored transposed ``(C, N)`` followed by V ``(N, C)``. Not known to every
  protocol-1 daemon: one without it refuses such a descriptor with ``invalid_message``.
- ``vllm_cpu_amx``: the same tensor as packed by vLLM's ``amx`` kernels (bfloat16, block sizes
  a multiple of 32, on CPUs with AMX): per block and head, K in tiles of 16 tokens, each
  ``(C/2, 16, 2)`` (channel pairs, then tokens, then the pair), followed by V in groups of 16
  channels, each ``(N/2, 16, 2)`` (token pairs, then channels, then the pair). Refused like
  ``vllm_cpu`` by a daemon without it.
- ``kv_cells``: ``(B, N, H, K+V)``, the per-layer views vLLM 0.32+ gives its GPU attention
  backends (FlashAttention, FlashInfer, Triton): one region per block whose every (token, head)
  cell holds K's channels then V's (``head_size`` is the cell's channel count, K and V
  together). It is moved, permuted, re-blocked and head-sliced exactly as ``split`` is (a cell
  never splits), but never exchanged with another arrangement. Refused like ``vllm_cpu`` by a
  daemon without it.
"""

MemoryOrder = Literal["NHD", "HND"]
"""Memory order inside one block: tokens-then-heads (NHD) or heads-then-tokens (HND)."""


class BufferDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one registered KV tensor holds and how its bytes are laid out.

    The logical shape is always the engine's view (block dim, then tokens, then heads); the memory
    order says whether tokens or heads vary slower inside a block. MLA buffers have no head dim:
    ``num_heads`` is 1 and ``memory_order`` is irrelevant (NHD by convention).
    """

    arrangement: Arrangement
    memory_order: MemoryOrder
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``"float16"``."""
    num_blocks: int
    block_size: int
    """Tokens per block."""
    num_heads: int
    head_size: int


IdsDtype = Literal["int32", "int64"]
"""Element type of a raw block-id frame (little-endian, C order)."""

Medium = Literal["device", "host"]
"""Which buffer set of a worker: its registered KV cache (``device``, whether GPU memory or CPU
shared memory) or its mirror region in the daemon's host pool (``host``)."""

PromptDigest = Annotated[str, msgspec.Meta(max_length=128)]
"""A digest naming the prompt whose KV a published request's blocks hold (the vLLM connector's:
64 hex digits of sha256); "" for none."""


class WorkerRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Names one registered worker: its engine and its ranks. Unique on a daemon."""

    engine_id: str
    tp_rank: int = 0
    pp_rank: int = 0
    dcp_rank: int = 0

    def label(self) -> str:
        """Short human-readable name, e.g. ``prefill/tp1.pp0.dcp0``."""
        return f"{self.engine_id}/tp{self.tp_rank}.pp{self.pp_rank}.dcp{self.dcp_rank}"


class BufferSetRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One side of a move: a worker's registered layers, or that worker's host-pool mirror."""

    worker: WorkerRef
    medium: Medium = "device"
    epoch: int = 0
    """The worker's registration epoch as the sender knows it (`Registered.epoch`); another
    current epoch fails the command with ``stale_epoch``. 0: not checked."""


class ShmRef(msgspec.Struct, frozen=True, tag="shm", tag_field="kind", forbid_unknown_fields=True):
    """A CPU tensor in shared memory whose storage fd was sent on the fd channel.

    Several refs may name the same ``fd_index``: tensors that are views of one storage (many
    layers in one region) share one fd, sent once and mapped once by the daemon. This is also the
    handle `kvsidecar.memory.shm` works with (``ShmHandle`` there).
    """

    fd_index: int
    """Index of the storage's fd among the fds sent under the registration's ``fd_token``."""
    storage_nbytes: int
    """Size of the whole storage (the mapping the daemon makes)."""
    offset: int
    """Byte offset of the tensor's first element within the storage."""
    nbytes: int
    """Bytes from the tensor's first to one past its last reachable byte (strides included)."""

    kind: ClassVar[Literal["shm"]] = "shm"
    """The handle's kind (also its tag on the wire)."""


class CudaIpcRef(
    msgspec.Struct, frozen=True, tag="cuda_ipc", tag_field="kind", forbid_unknown_fields=True
):
    """A CUDA tensor exported by CUDA IPC, the way torch shares CUDA storages.

    Also the handle `kvsidecar.memory.cuda_ipc` works with (``CudaIpcHandle`` there).
    """

    device: int
    """CUDA device index in the worker (the daemon must see the same devices)."""
    ipc_handle: bytes
    """``cudaIpcMemHandle_t`` of the allocation the storage lives in."""
    storage_nbytes: int
    """Size of the storage."""
    storage_offset: int
    """Byte offset of the storage within the CUDA allocation."""
    ref_counter_handle: bytes
    """Name of torch's shared reference-counter file."""
    ref_counter_offset: int
    """Slot of this export in the reference-counter file."""
    event_handle: bytes | None
    """IPC handle of the event to wait on before reading (None when none is needed)."""
    event_sync_required: bool
    """Whether the consumer must wait on ``event_handle``."""
    offset: int
    """Byte offset of the tensor within its storage."""
    nbytes: int
    """Bytes from the tensor's first to one past its last reachable byte."""
    device_uuid: str = ""
    """UUID of the worker's GPU (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``). The daemon opens
    the handle on its own index of that GPU, whatever index the worker sees it under (a
    container often sees its GPU as ``cuda:0``), and refuses the handle when it cannot see that
    GPU. Empty (older clients): ``device`` is used as the daemon's index."""

    kind: ClassVar[Literal["cuda_ipc"]] = "cuda_ipc"
    """The handle's kind (also its tag on the wire)."""

    def storage_key(self) -> tuple[bytes, int]:
        """Identify the storage: handles with equal keys are views of one storage."""
        return self.ipc_handle, self.storage_offset


class CudaVmmRef(
    msgspec.Struct, frozen=True, tag="cuda_vmm", tag_field="kind", forbid_unknown_fields=True
):
    """A CUDA tensor in virtual-memory (``cuMemCreate``) allocations, exported as POSIX fds.

    Memory that legacy CUDA IPC cannot share (torch's ``expandable_segments``, allocators built
    on ``cuMemCreate``) is exported chunk by chunk with ``cuMemExportToShareableHandle``: one fd
    per physical allocation, sent on the fd channel like shm fds. The daemon imports each chunk,
    maps them one after another into one reserved address range and reads the tensor at
    ``offset`` in it. Only sent to a daemon whose `HelloReply.capabilities` has ``cuda_vmm``.
    Also the handle `kvsidecar.memory.cuda_vmm` works with.
    """

    device: int
    """CUDA device index in the worker (informative; ``device_uuid`` decides)."""
    device_uuid: str
    """UUID of the GPU the memory lives on (see `CudaIpcRef.device_uuid`)."""
    fd_index: int
    """Index of the first chunk's fd among the registration's fds; chunk ``i`` is at
    ``fd_index + i``."""
    chunk_nbytes: list[int]
    """Size of each physical allocation, in address order; they are mapped back to back."""
    offset: int
    """Byte offset of the tensor's first element from the start of the first chunk."""
    nbytes: int
    """Bytes from the tensor's first to one past its last reachable byte."""

    kind: ClassVar[Literal["cuda_vmm"]] = "cuda_vmm"
    """The handle's kind (also its tag on the wire)."""

    def span_key(self) -> tuple[int, int]:
        """Identify the mapping: handles with equal keys are views of one set of chunks."""
        return self.fd_index, len(self.chunk_nbytes)


HandleRef = ShmRef | CudaIpcRef | CudaVmmRef
"""How the daemon maps a registered layer's memory."""


class MoveEvents(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """CUDA events that order a move against the engine's own GPU work (`Move.events`).

    Both are interprocess events of the caller's GPU (``cudaIpcGetEventHandle``, 64 bytes).
    """

    device_uuid: str
    """The GPU the events belong to (see `CudaIpcRef.device_uuid`); one side of the move must
    be registered memory on it."""
    ready: bytes
    """Recorded by the caller on its current stream when it sent the move: the daemon's copy
    waits for it, so the move sees every write (and no later read) the engine enqueued before."""
    done: bytes = b""
    """Recorded by the daemon after the copy (and any layout fix): the caller's stream waits for
    it before the engine reads the destination. Empty: none."""


class LayerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered KV tensor: its name (unique per worker), its layout, and its handle."""

    name: str
    descriptor: BufferDescriptor
    handle: HandleRef


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The layout a worker's blocks were written in by a raw copy (the sender's layout)."""

    memory_order: MemoryOrder
    block_size: int


class BufferInfo(msgspec.Struct, frozen=True):
    """One registered layer as status reports it."""

    name: str
    kind: str
    nbytes: int
    descriptor: BufferDescriptor


class WorkerInfo(msgspec.Struct, frozen=True):
    """One registered worker as status reports it."""

    worker: WorkerRef
    tp_size: int
    pp_size: int
    dcp_size: int
    layers: list[BufferInfo]
    nbytes: int
    host_mirror_bytes: int
    lease_left_s: float
    in_flight: int


class EngineInfo(msgspec.Struct, frozen=True):
    """One engine as status reports it."""

    engine_id: str
    model_hash: str
    workers: list[WorkerInfo]
    host_blocks: int
    host_blocks_used: int

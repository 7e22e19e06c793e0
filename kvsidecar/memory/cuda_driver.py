"""The few CUDA driver calls torch does not expose, through ctypes on ``libcuda.so.1``.

Two jobs need the driver API itself: asking a pointer whether legacy CUDA IPC can share it
(``CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE``), and the VMM path of `kvsidecar.memory.
cuda_vmm` (export a ``cuMemCreate`` allocation as a POSIX fd, import it in the daemon, map it).
``libcuda.so.1`` comes with the NVIDIA driver, so this adds no dependency; it is loaded on first
use, and where it is missing every call raises `HandleError` ``cuda_unavailable``.

Every prototype is declared once in `PROTOTYPES` (the C signature from ``cuda.h`` in ctypes
types), so argument widths are checked by ctypes instead of guessed per call. Only this module
talks to the driver; the structs below follow ``cuda.h`` (CUDA 12) byte for byte.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

from kvsidecar.memory.base import HandleError

__all__ = [
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "LIBRARY_ENV",
    "PROTOTYPES",
    "AllocationProp",
    "Driver",
    "MemAccessDesc",
    "MemLocation",
    "driver",
]

LIBRARY_ENV = "KVSIDECAR_LIBCUDA"
"""Environment variable naming another driver library to load (tests point it at a stub)."""

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801

# CUpointer_attribute (cuda.h)
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_POINTER_ATTRIBUTE_MAPPING_SIZE = 18
CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR = 19

# CUmemAllocationHandleType: a bit mask
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_HANDLE_TYPE_FABRIC = 0x8

CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: 8 bytes."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    """``CUmemAllocationProp``: 32 bytes."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class MemAccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: 12 bytes."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


_ptr = ctypes.c_void_p
_u64 = ctypes.c_uint64
_size = ctypes.c_size_t
_int = ctypes.c_int
_uint = ctypes.c_uint

PROTOTYPES: dict[str, list[Any]] = {
    # name: argtypes (every function returns CUresult, an int)
    "cuInit": [_uint],
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDeviceGetCount": [ctypes.POINTER(_int)],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_ptr), _int],
    "cuCtxSetCurrent": [_ptr],
    "cuPointerGetAttribute": [_ptr, _int, _u64],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_u64), ctypes.POINTER(_size), _u64],
    "cuMemRetainAllocationHandle": [ctypes.POINTER(_u64), _ptr],
    "cuMemGetAllocationPropertiesFromHandle": [ctypes.POINTER(AllocationProp), _u64],
    "cuMemExportToShareableHandle": [_ptr, _u64, _int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), _ptr, _int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(MemAccessDesc), _size],
    "cuMemRelease": [_u64],
}
"""The C signatures (``cuda.h``, CUDA 12) of every driver function used, as ctypes argtypes."""


class Driver:
    """``libcuda`` with `PROTOTYPES` applied; each method raises `HandleError` on a CUresult."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        missing = [name for name in PROTOTYPES if not hasattr(lib, name)]
        if missing:
            raise HandleError(
                "cuda_unavailable", f"the CUDA driver lacks {', '.join(missing)} (too old?)"
            )
        self._fns: dict[str, Callable[..., int]] = {}
        for name, argtypes in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._call("cuInit", 0)

    def error_name(self, code: int) -> str:
        """``CUDA_ERROR_...`` for a CUresult (or the number when the driver does not know it)."""
        name = ctypes.c_char_p()
        if self._fns["cuGetErrorName"](code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {code}"
        return name.value.decode()

    def _call(self, name: str, *args: Any) -> None:
        result = self._fns[name](*args)
        if result != CUDA_SUCCESS:
            raise HandleError("cuda_error", f"{name} failed: {self.error_name(result)}")

    def use_device(self, ordinal: int) -> None:
        """Make ``ordinal``'s primary context (the one torch uses) current on this thread.

        The driver calls that follow on this thread act on that context.
        """
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
                handle = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), dev.value)
                ctx = self._contexts[ordinal] = int(handle.value or 0)
        self._call("cuCtxSetCurrent", ctypes.c_void_p(ctx))

    def pointer_attribute(self, attribute: int, ptr: int) -> int:
        """One ``cuPointerGetAttribute`` value as an integer.

        The driver writes a bool, an int, a size or an address depending on the attribute; a
        zeroed 8-byte slot read as one little-endian integer holds any of them.
        """
        out = ctypes.c_uint64(0)
        self._call("cuPointerGetAttribute", ctypes.byref(out), attribute, ptr)
        return int(out.value)

    def legacy_ipc_capable(self, ptr: int) -> bool:
        """Whether ``cudaIpcGetMemHandle`` can share the allocation ``ptr`` lies in."""
        return bool(self.pointer_attribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr))

    def allowed_handle_types(self, ptr: int) -> int:
        """Return the ``CUmemAllocationHandleType`` bits the allocation may be exported as."""
        return self.pointer_attribute(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr)

    def mapping_range(self, ptr: int) -> tuple[int, int]:
        """Return ``(base, size)`` of the mapping (one physical allocation) ``ptr`` lies in."""
        base = ctypes.c_uint64(0)
        size = ctypes.c_uint64(0)
        first = self._fns["cuPointerGetAttribute"](
            ctypes.byref(base), CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, ptr
        )
        second = self._fns["cuPointerGetAttribute"](
            ctypes.byref(size), CU_POINTER_ATTRIBUTE_MAPPING_SIZE, ptr
        )
        if first == CUDA_SUCCESS and second == CUDA_SUCCESS and size.value:
            return int(base.value), int(size.value)
        # Older drivers do not know the mapping attributes; this call answers the same
        # for a VMM mapping (the range of the one cuMemMap call that covers ptr).
        b, s = ctypes.c_uint64(0), ctypes.c_size_t(0)
        self._call("cuMemGetAddressRange_v2", ctypes.byref(b), ctypes.byref(s), ptr)
        return int(b.value), int(s.value)

    def export_fd(self, ptr: int) -> tuple[int, int]:
        """Export the allocation mapped at ``ptr`` as a new POSIX fd: ``(fd, device ordinal)``.

        The fd belongs to the caller (close it once sent).
        """
        handle = ctypes.c_uint64(0)
        self._call("cuMemRetainAllocationHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        try:
            prop = AllocationProp()
            self._call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop), handle.value)
            fd = ctypes.c_int(-1)
            self._call(
                "cuMemExportToShareableHandle",
                ctypes.byref(fd),
                handle.value,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        finally:
            self._call("cuMemRelease", handle.value)
        return int(fd.value), int(prop.location.id)

    # Building a mapping (the importing side): a context must be current.

    def import_fd(self, fd: int) -> int:
        """Import an exported fd as an allocation handle (the fd stays the caller's)."""
        handle = ctypes.c_uint64(0)
        self._call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),  # the fd travels as the pointer-sized "OS handle"
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        return int(handle.value)

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space; returns the base address."""
        base = ctypes.c_uint64(0)
        self._call("cuMemAddressReserve", ctypes.byref(base), size, 0, 0, 0)
        return int(base.value)

    def free_address(self, base: int, size: int) -> None:
        """Give back a reservation made by `reserve`."""
        self._call("cuMemAddressFree", base, size)

    def map(self, address: int, size: int, handle: int) -> None:
        """Map all ``size`` bytes of an allocation handle at ``address``."""
        self._call("cuMemMap", address, size, 0, handle, 0)

    def unmap(self, address: int, size: int) -> None:
        """Remove the mapping of ``[address, address + size)``."""
        self._call("cuMemUnmap", address, size)

    def allow_read_write(self, address: int, size: int, ordinal: int) -> None:
        """Let device ``ordinal`` read and write ``[address, address + size)``."""
        desc = MemAccessDesc(
            MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        self._call("cuMemSetAccess", address, size, ctypes.byref(desc), 1)

    def release(self, handle: int) -> None:
        """Drop one reference to an allocation handle (a mapping keeps its own)."""
        self._call("cuMemRelease", handle)


_loaded: dict[str, Driver] = {}
"""The driver loaded from each library path."""
_load_lock = threading.Lock()


def driver() -> Driver:
    """Return the process's `Driver`, loaded on first use; ``cuda_unavailable`` without one.

    ``KVSIDECAR_LIBCUDA`` names another library (the tests' stub driver).
    """
    path = os.environ.get(LIBRARY_ENV) or "libcuda.so.1"
    with _load_lock:
        found = _loaded.get(path)
        if found is None:
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise HandleError(
                    "cuda_unavailable", f"cannot load the CUDA driver ({path}): {exc}"
                ) from None
            found = _loaded[path] = Driver(lib)
        return found

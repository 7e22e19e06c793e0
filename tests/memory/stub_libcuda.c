/* A stand-in for libcuda.so.1 with the CUDA 12 prototypes kvsidecar.memory.cuda_driver calls.
 *
 * "Device memory" is host memory with the semantics of the driver's VMM API: an allocation is a
 * memfd, exporting it as a POSIX fd hands out a dup of that memfd, importing an fd keeps a dup,
 * cuMemAddressReserve reserves address space (PROT_NONE), cuMemMap maps the memfd there, and
 * cuMemUnmap / cuMemAddressFree undo it. So bytes written through the exporter's mapping are read
 * through the importer's, fds can be counted, and every argument crosses ctypes exactly as it
 * would to the real driver. Built by tests/memory/test_cuda_vmm.py with the system C compiler.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage;
           unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_CONTEXT = 201,
       NOT_PERMITTED = 800, NOT_SUPPORTED = 801 };
#define MAX 4096

/* exported allocations (the worker's side): one memfd each, mapped at base */
static struct { CUdeviceptr base; size_t size; int memfd; int types; int live; } allocs[MAX];
static int nallocs;
/* imported handles (the daemon's side): a dup of the received fd each */
static struct { int fd; size_t size; int live; } imports[MAX];
/* mappings made by cuMemMap */
static struct { CUdeviceptr at; size_t size; int live; } maps[MAX];
static int nmaps;
static int initialized, current_ctx, reservations, access_calls, access_ordinal = -1;
static int retained; /* allocation handles retained and not yet released */

CUresult cuInit(unsigned int flags) { initialized = flags == 0; return initialized ? OK : INVALID_VALUE; }

CUresult cuGetErrorName(CUresult code, const char **name) {
  static char buf[64];
  snprintf(buf, sizeof buf, "CUDA_ERROR_STUB_%d", code);
  *name = buf;
  return OK;
}

CUresult cuDeviceGet(int *dev, int ordinal) { if (ordinal < 0 || ordinal > 7) return INVALID_VALUE; *dev = ordinal; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 8; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(uintptr_t)(0x1000 + dev); return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current_ctx = (int)(uintptr_t)ctx; return OK; }

static int find_alloc(CUdeviceptr p) {
  for (int i = 0; i < nallocs; i++)
    if (allocs[i].live && allocs[i].base <= p && p < allocs[i].base + allocs[i].size) return i;
  return -1;
}

/* Writes each attribute with the width the real driver writes: bool, 8-byte mask, size, address. */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  int i = find_alloc(ptr);
  if (i < 0) return INVALID_VALUE;
  switch (attribute) {
    case 10: *(unsigned char *)data = 0; return OK;                 /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 14: *(unsigned long long *)data = allocs[i].types; return OK; /* ALLOWED_HANDLE_TYPES */
    case 18: *(size_t *)data = allocs[i].size; return OK;           /* MAPPING_SIZE */
    case 19: *(CUdeviceptr *)data = allocs[i].base; return OK;      /* MAPPING_BASE_ADDR */
    default: return NOT_SUPPORTED;
  }
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  int i = find_alloc(ptr);
  if (i < 0) return INVALID_VALUE;
  *base = allocs[i].base; *size = allocs[i].size;
  return OK;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
  int i = find_alloc((CUdeviceptr)(uintptr_t)addr);
  if (i < 0) return INVALID_VALUE;
  *h = (CUmemGenericAllocationHandle)(i + 1);
  retained++;
  return OK;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  if (h < 1 || h > (unsigned long long)nallocs) return INVALID_VALUE;
  memset(prop, 0, sizeof *prop);
  prop->type = 1;
  prop->requestedHandleTypes = allocs[h - 1].types;
  prop->location.type = 1;
  prop->location.id = 0;
  return OK;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
  if (h < 1 || h > (unsigned long long)nallocs || flags != 0) return INVALID_VALUE;
  if (type != 1 || !(allocs[h - 1].types & 1)) return NOT_PERMITTED;
  int fd = dup(allocs[h - 1].memfd);
  if (fd < 0) return INVALID_VALUE;
  *(int *)out = fd;
  return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
  struct stat st;
  int fd = (int)(intptr_t)os_handle;
  if (type != 1 || fstat(fd, &st) != 0 || st.st_size <= 0) return INVALID_VALUE;
  for (int i = 0; i < MAX; i++)
    if (!imports[i].live) {
      imports[i].fd = dup(fd);
      imports[i].size = (size_t)st.st_size;
      imports[i].live = 1;
      *h = (CUmemGenericAllocationHandle)(10000 + i);
      return OK;
    }
  return INVALID_VALUE;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  if (!current_ctx) return INVALID_CONTEXT;
  if (size == 0 || align != 0 || addr != 0 || flags != 0) return INVALID_VALUE;
  void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return INVALID_VALUE;
  *ptr = (CUdeviceptr)(uintptr_t)p;
  reservations++;
  return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  if (munmap((void *)(uintptr_t)ptr, size) != 0) return INVALID_VALUE;
  reservations--;
  return OK;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  int i = (int)h - 10000;
  if (i < 0 || i >= MAX || !imports[i].live || offset != 0 || flags != 0) return INVALID_VALUE;
  if (size != imports[i].size) return INVALID_VALUE; /* a whole allocation, as the driver wants */
  void *p = mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, imports[i].fd, 0);
  if (p == MAP_FAILED) return INVALID_VALUE;
  maps[nmaps].at = ptr; maps[nmaps].size = size; maps[nmaps].live = 1; nmaps++;
  return OK;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  for (int i = 0; i < nmaps; i++)
    if (maps[i].live && maps[i].at == ptr && maps[i].size == size) {
      mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      maps[i].live = 0;
      return OK;
    }
  return INVALID_VALUE;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  if (count != 1 || desc->location.type != 1 || desc->flags != 3 || size == 0 || ptr == 0) return INVALID_VALUE;
  access_calls++;
  access_ordinal = desc->location.id;
  return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  if (h >= 10000) {
    int i = (int)h - 10000;
    if (i >= MAX || !imports[i].live) return INVALID_VALUE;
    close(imports[i].fd); /* the mapping keeps the pages: mmap holds its own reference */
    imports[i].live = 0;
    return OK;
  }
  if (h < 1 || h > (unsigned long long)nallocs || retained <= 0) return INVALID_VALUE;
  retained--;
  return OK;
}

/* --- for the tests only ---------------------------------------------------------------- */

/* An allocation of n chunks of `size` bytes mapped back to back, exportable as `types`. */
CUdeviceptr stub_alloc(int n, size_t size, int types) {
  char *base = mmap(NULL, n * size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return 0;
  for (int k = 0; k < n; k++) {
    int fd = memfd_create("stub-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0) return 0;
    mmap(base + k * size, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    allocs[nallocs].base = (CUdeviceptr)(uintptr_t)(base + k * size);
    allocs[nallocs].size = size;
    allocs[nallocs].memfd = fd;
    allocs[nallocs].types = types;
    allocs[nallocs].live = 1;
    nallocs++;
  }
  return (CUdeviceptr)(uintptr_t)base;
}

/* Counters: live imports, live mappings, live reservations, access calls, last access ordinal,
 * the current context, allocation handles retained. */
void stub_stats(long long out[7]) {
  int live_imports = 0, live_maps = 0;
  for (int i = 0; i < MAX; i++) live_imports += imports[i].live;
  for (int i = 0; i < nmaps; i++) live_maps += maps[i].live;
  out[0] = live_imports; out[1] = live_maps; out[2] = reservations; out[3] = access_calls;
  out[4] = access_ordinal; out[5] = current_ctx; out[6] = retained;
}

"""Whether the daemon can use CUDA: checked once at start-up when ``require_cuda`` is set.

A daemon that cannot see the node's GPUs still starts and serves shared-memory engines; it fails
only when the first engine registers CUDA buffers, which is the wrong moment to learn that the
container was not given the GPUs (a container without a GPU request often sees none:
``NVIDIA_VISIBLE_DEVICES`` is ignored under CDI and for unprivileged containers on some
distributions). ``require_cuda`` moves that failure to start-up, with a message that says which
part is missing. docs/operations.md ("GPU nodes") lists the ways to give the daemon the GPUs.
"""

from __future__ import annotations

import logging
import os

from kvsidecar.node.config import ConfigError

log = logging.getLogger(__name__)

_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
"""Device nodes every CUDA process opens; their absence names the usual cause."""

_VISIBILITY_VARS = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def cuda_problem() -> str | None:
    """Why CUDA is unusable in this process, or None when it works and shows a GPU."""
    import torch

    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU build (run the -cu12x image, or install torch "
            "from a CUDA index)"
        )
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    missing = [path for path in _DEVICE_NODES if not os.path.exists(path)]
    nodes = f"missing {', '.join(missing)}" if missing else "device nodes present"
    env = ", ".join(f"{name}={os.environ.get(name, '(unset)')}" for name in _VISIBILITY_VARS)
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU ({nodes}; {env})"


def describe_cuda() -> str:
    """One line naming the GPUs this process sees (for the start-up log)."""
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}"


def check_cuda(required: bool) -> None:
    """Raise `ConfigError` when ``required`` and CUDA is unusable; log what is seen otherwise."""
    if not required:
        return
    problem = cuda_problem()
    if problem is not None:
        raise ConfigError(
            f"require_cuda is set but CUDA is not usable here: {problem}. "
            "See docs/operations.md, 'GPU nodes'."
        )
    log.info("require_cuda: %s", describe_cuda())

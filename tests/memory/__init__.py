"""Buffer handles by kind: shared memory and the fd channel, the host pool, CUDA IPC and VMM."""

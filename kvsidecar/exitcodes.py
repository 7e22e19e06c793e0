"""Exit codes of the ``kvsidecar`` command, shared by its subcommands (also in docs/operations.md).

====  =====================================================
0     success
1     the command ran and failed (a demo check, a daemon error)
2     usage error (bad flags)
3     invalid configuration
4     the daemon could not be reached
====  =====================================================
"""

EXIT_OK = 0
"""Success."""
EXIT_FAILED = 1
"""The command ran and failed (a demo check, a daemon error)."""
EXIT_USAGE = 2
"""Usage error (bad flags)."""
EXIT_CONFIG = 3
"""Invalid configuration."""
EXIT_UNREACHABLE = 4
"""The daemon could not be reached."""

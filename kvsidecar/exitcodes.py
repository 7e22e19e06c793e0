"""Exit codes of the ``kvsidecar`` command, shared by its subcommands (also in docs/operations.md).

====  =====================================================
0     success
1     the command ran and failed (a demo check, a daemon error, a refused start)
2     usage error (an unknown flag)
3     invalid configuration (a setting's value, from a flag, the environment or a file)
4     the daemon could not be reached
====  =====================================================
"""

EXIT_OK = 0
"""Success."""
EXIT_FAILED = 1
"""The command ran and failed (a demo check, a daemon error)."""
EXIT_USAGE = 2
"""Usage error (an unknown flag)."""
EXIT_CONFIG = 3
"""Invalid configuration (a setting's value, from a flag, the environment or a file)."""
EXIT_UNREACHABLE = 4
"""The daemon could not be reached."""

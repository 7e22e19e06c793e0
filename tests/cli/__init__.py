"""The ``kvsidecar`` command as a subprocess: its subcommands, ``bench`` among them."""

"""``python -m kvsidecar.daemon``: serve with settings from ``KVSIDECAR_*`` (see `server.main`)."""

from kvsidecar.daemon.server import main

main()

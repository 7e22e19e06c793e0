"""``python -m kvsidecar.daemon``: serve with settings from ``KVSIDECAR_*`` and exit.

``KVSIDECAR_CONFIG`` may name a TOML file. The CLI (``kvsidecar serve``) is the documented entry
point; this one exists for tests and minimal containers.
"""

import logging
import os
import sys

import prometheus_client

from kvsidecar.daemon.server import Daemon
from kvsidecar.node.config import Config
from kvsidecar.peer.process_exit import finish_process

config = Config.load(os.environ.get("KVSIDECAR_CONFIG"))
logging.basicConfig(
    level=config.log_level.upper(),
    format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    stream=sys.stderr,
)
# Process-wide, hence in the entry point and not in the library (see kvsidecar.cli).
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def _serve() -> int:
    Daemon(config).run()
    return 0


# A daemon that made a NIXL agent leaves without the bundled libraries' exit handlers (they crash).
sys.exit(finish_process(_serve))

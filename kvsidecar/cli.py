"""The ``kvsidecar`` command: builds a `Config` or a client and hands over to the library.

Exit codes are in `kvsidecar.exitcodes` (and ``docs/operations.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvsidecar import __version__
from kvsidecar.daemon.logs import setup_logging
from kvsidecar.exitcodes import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from kvsidecar.node.config import Config, ConfigError
from kvsidecar.node.settings import SETTINGS, Setting


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, generated from the settings table so none can be missing."""
    group = parser.add_argument_group(
        "settings", "each also read from the TOML file and from its KVSIDECAR_* variable"
    )
    for setting in SETTINGS:
        kwargs: dict[str, Any] = {
            "dest": setting.name,
            "default": None,
            "help": (
                f"{setting.help} [env {setting.env_var}; default {_show(setting)}{_range(setting)}]"
            ),
        }
        if setting.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:  # parsed and checked by `Config`, as from the environment and the file
            kwargs["metavar"] = setting.type.__name__.upper()
        group.add_argument(setting.flag, **kwargs)


def _range(setting: Setting) -> str:
    if setting.low is None or setting.high is None:
        return ""
    return f"; {_plain(setting.low)} to {_plain(setting.high)}"


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(setting: Setting) -> str:
    return repr(setting.default) if setting.default != "" else "derived"


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=os.environ.get("KVSIDECAR_CONFIG"),
        help="TOML settings file (flat, or under a [kvsidecar] table) [env KVSIDECAR_CONFIG]",
    )


def _load_config(args: argparse.Namespace) -> Config:
    overrides = {s.name: getattr(args, s.name, None) for s in SETTINGS}
    return Config.load(args.config, overrides=overrides)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the usage itself is in ``--help``)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with `EXIT_USAGE`."""
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of every subcommand."""
    parser = _Parser(
        prog="kvsidecar",
        description="Per-node daemon that moves KV-cache blocks for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("KVSIDECAR_LOG_FORMAT", "text"),
        help="log lines as text or as one JSON object each [env KVSIDECAR_LOG_FORMAT]",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon until SIGTERM/SIGINT")
    _add_config_flag(serve)
    _add_setting_flags(serve)

    check = sub.add_parser(
        "check-config", help="validate the settings (file, environment, flags) and print them"
    )
    _add_config_flag(check)
    _add_setting_flags(check)

    status = sub.add_parser("status", help="print a running daemon's state as a table")
    status.add_argument(
        "--endpoint",
        default=None,
        help="control endpoint of the daemon [default: the configured or default ipc endpoint]",
    )
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")

    keygen = sub.add_parser(  # security
        "keygen",
        help="write a CurveZMQ key pair: <dir>/<name>.key (public) and .key_secret (mode 0600)",
    )
    keygen.add_argument("directory", help="where to write the key files (created if missing)")
    keygen.add_argument("--name", default="kvsidecar", help="file name stem [kvsidecar]")

    demo = sub.add_parser(
        "demo",
        help="start a daemon and engine-worker processes, move and fix blocks, verify every byte",
    )
    demo.add_argument("--layers", type=int, default=8, help="layers per worker")
    demo.add_argument("--blocks", type=int, default=512, help="KV blocks per layer")
    demo.add_argument("--rounds", type=int, default=3, help="rounds of every move kind")
    demo.add_argument("--keep-going", action="store_true", help=argparse.SUPPRESS)

    from kvsidecar.bench.cli import add_bench_parser  # light: no torch at parse time

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvsidecar`` console script; returns the exit code.

    A process that made a NIXL agent (a daemon, a bench) ends here instead, with that code:
    `kvsidecar.peer.process_exit` says why.
    """
    from kvsidecar.peer.process_exit import finish_process

    return finish_process(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            config = _load_config(args)
            setup_logging(config.log_level, args.log_format)
            import prometheus_client

            from kvsidecar.daemon.server import Daemon

            # Process-wide, hence here and not in the library: no `_created` series per counter.
            prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

            Daemon(config).run()
            return EXIT_OK
        if args.command == "check-config":
            config = _load_config(args)
            for setting in SETTINGS:
                print(f"{setting.name} = {getattr(config, setting.name)!r}")
            return EXIT_OK
        if args.command == "status":
            setup_logging("warning", args.log_format)
            from kvsidecar.status import print_status

            return print_status(args.endpoint, timeout=args.timeout)
        if args.command == "keygen":  # security
            from kvsidecar.wire.curve import keygen

            try:
                public, secret = keygen(args.directory, args.name)
            except FileExistsError as exc:
                print(f"kvsidecar: {exc}", file=sys.stderr)
                return EXIT_FAILED
            print(f"public key: {public}\nsecret key: {secret} (mode 0600)")
            return EXIT_OK
        if args.command == "demo":
            setup_logging("warning", args.log_format)
            from kvsidecar.demo import run_demo

            return run_demo(layers=args.layers, blocks=args.blocks, rounds=args.rounds)
        if args.command == "bench":
            setup_logging("warning", args.log_format)
            from kvsidecar.bench.cli import run_bench

            return run_bench(args)
    except ConfigError as exc:
        print(f"kvsidecar: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        config_file = args.__dict__.get("config")
        if config_file is not None and exc.filename == config_file:
            print(f"kvsidecar: cannot read config: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        raise
    # argparse rejects unknown commands before this point; reaching it is a programming error.
    print(f"kvsidecar: unhandled command {args.command!r}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""``megatron-rl verifier-server``: score for orchestrators on other nodes (a verifier pool over HTTP).

    export MEGATRON_RL_VERIFIER_KEY=$(openssl rand -hex 32)       # the same on the orchestrator
    megatron-rl verifier-server --workers 64 --host 0.0.0.0 --port 8400 \\
        --api-key-env MEGATRON_RL_VERIFIER_KEY

then in the recipe: ``reward.remote: [http://node7:8400, ...]`` (the orchestrator reads the key
from the variable ``reward.remote_api_key_env`` names, by default the one above). It prints the
URL it serves and runs until SIGTERM or Ctrl-C, then stops its verifier processes (what is queued
is dropped: the orchestrators run it elsewhere) and exits 0. Also ``python -m
megatron_rl.cli.verifier_server``. See ``megatron_rl/rewards/remote_server.py`` for the routes and
what the server checks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from megatron_rl.errors import ArgumentParser, UsageError, int_arg, run_cli

__all__ = ["build_parser", "main"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or ArgumentParser(prog="megatron-rl verifier-server", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers",
        type=int_arg(1, 4096),
        default=os.cpu_count() or 1,
        help="verifier processes (default: one per core)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a key)"
    )
    p.add_argument(
        "--port",
        type=int_arg(0, 65535, " (0: any free port)"),
        default=8400,
        help="port (default 8400; 0: any free one)",
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the API key clients must send (Authorization: Bearer)",
    )
    p.add_argument(
        "--allow-custom",
        metavar="NAME",
        action="append",
        default=[],
        help="a reward.custom this server may run (module:function or a registered name); repeatable",
    )
    p.add_argument(
        "--max-body-mb", type=int_arg(1, 1 << 20), default=64, help="largest request body (default 64)"
    )
    p.add_argument(
        "--max-tasks", type=int_arg(1, 1 << 20), default=1024, help="most tasks in one request (default 1024)"
    )
    p.set_defaults(func=serve)
    return p


def serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean stop. Every flag is checked before the port
    is bound or a verifier process starts."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port: must be in [0, 65535], got {args.port}")
    key = ""
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise UsageError(
                f"--api-key-env {args.api_key_env}: that environment variable is not set or empty"
            )
    from megatron_rl.rewards.remote_server import VerifierServer  # lazy: --help imports no verifier

    for name in args.allow_custom:  # a name that does not resolve fails here, not at the first request
        from megatron_rl.rewards.custom import resolve  # lazy: as above

        try:
            resolve(name)
        except UsageError as e:
            raise UsageError(f"--allow-custom {name}: {e}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = VerifierServer(
        args.workers,
        host=args.host,
        port=args.port,
        api_key=key,
        allow_custom=args.allow_custom,
        max_body_mb=args.max_body_mb,
        max_tasks=args.max_tasks,
    )
    try:
        server.start()
        print(
            f"verifier server: {server.url} ({args.workers} workers, "
            f"{'API key required' if key else 'no API key'})",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    finally:
        server.close(cancel=True)
    print("verifier server: stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl verifier-server", main))

"""``megatron-rl serve-engine``'s arguments, every one checked before the model is loaded.

A bad argument is one line naming the flag and what is allowed (:mod:`megatron_rl.errors`):
a number out of its range or not a number (exit 2), a ``--model`` folder without a readable
``config.json`` or a ``--timing-model`` file that is missing or bad (3), a ``--port-file`` whose
folder does not exist (4), a port in use (5). The listening socket is bound here too, before the
model loads, so that a port in use is reported in a second rather than after the load.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.errors import ArgumentParser, InputError, OutputError, ResourceError, UsageError
from megatron_rl.generation.engine.http import (
    DEFAULT_MAX_CONNS_PER_CLIENT,
    DEFAULT_READ_TIMEOUT_S,
    EngineHTTPServer,
)
from megatron_rl.generation.engine.timing import TimingConfig
from megatron_rl.generation.protocol import API_KEY_ENV, api_key_from_env, check_api_key

__all__ = ["ServeArgs", "bind", "parse_serve_args"]

# Ranges of the numeric flags. The upper ends are far past any real use; they are there so that a
# typo (an extra zero or two) is refused by name rather than failing as an allocation later.
_MAX_SLOTS = 1 << 16
_MAX_LEN = 1 << 24
_MAX_THREADS = 4096
_MAX_BODY_MB = 1 << 20  # 1 TiB
_MAX_TIMEOUT_S = 86400.0
_MAX_CONNS = 1 << 20


def _int_in(lo: int, hi: int, what: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{lo}, {hi}]{what}, got {text!r}"
            ) from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}]{what}, got {v}")
        return v

    return parse


def _positive_float(hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and 0 < v <= hi):
            raise argparse.ArgumentTypeError(f"must be a number in (0, {hi:.0f}], got {text!r}")
        return v

    return parse


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="megatron-rl serve-engine", description="serve an HF model with the built-in engine"
    )
    p.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=_int_in(0, 65535, " (0 picks a free port)"), default=30000)
    p.add_argument("--max-slots", type=_int_in(1, _MAX_SLOTS), default=16, help="sequences decoded together")
    p.add_argument(
        "--max-len", type=_int_in(2, _MAX_LEN), default=2048, help="prompt + completion tokens per slot"
    )
    p.add_argument(
        "--threads",
        type=_int_in(0, _MAX_THREADS, " (0: torch default)"),
        default=0,
        help="torch CPU threads (0: torch default)",
    )
    p.add_argument(
        "--weight-version", type=_int_in(0, 2**63 - 1), default=0, help="version of the loaded weights"
    )
    p.add_argument("--port-file", help="write the bound port here (atomic) once serving")
    p.add_argument(
        "--max-body-mb",
        type=_positive_float(_MAX_BODY_MB),
        default=64.0,
        help="largest request body read; larger: 413 unread",
    )
    p.add_argument(
        "--read-timeout-s",
        type=_positive_float(_MAX_TIMEOUT_S),
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds a client has to send a whole request, line, headers and body together "
        "(and to take its answer); past it: 408, or closed. An idle keep-alive connection is "
        "closed after it too",
    )
    p.add_argument(
        "--max-conns-per-client",
        type=_int_in(0, _MAX_CONNS, " (0: no limit)"),
        default=DEFAULT_MAX_CONNS_PER_CLIENT,
        help="connections one client address may hold at once; the next is answered 503 and "
        "closed (a trainer opens one per in-flight sample: size it for that)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="every route but /health and /health_generate then wants 'Authorization: Bearer KEY' "
        f"(SGLang's flag); default ${API_KEY_ENV}, which unlike argv does not show in ps; "
        "neither: no key",
    )
    p.add_argument(
        "--timing-model",
        metavar="FILE.json",
        help="no model compute: steps sleep for this cost model and write its token "
        "script (generation/engine/timing.py); --model gives EOS and vocab only",
    )
    return p


@dataclass(kw_only=True)
class ServeArgs:
    """The checked arguments of ``serve-engine``."""

    model: str  # HF model folder
    hf_config: dict[str, object]  # its config.json
    host: str
    port: int  # 0: a free one
    max_slots: int
    max_len: int
    threads: int  # 0: torch's default
    weight_version: int
    port_file: str | None
    max_body_mb: float
    read_timeout_s: float
    max_conns_per_client: int  # 0: no limit
    api_key: str  # "": none
    timing: TimingConfig | None  # --timing-model's cost model, read


def parse_serve_args(argv: list[str] | None) -> ServeArgs:
    """Every argument parsed and checked (files included); the error of its kind otherwise."""
    a = _parser().parse_args(argv)
    if a.api_key is not None:
        try:
            api_key = check_api_key(a.api_key)
        except ValueError:
            raise UsageError("--api-key: must be printable ASCII without spaces") from None
    else:
        try:
            api_key = api_key_from_env()
        except ValueError:
            raise UsageError(f"${API_KEY_ENV}: must be printable ASCII without spaces") from None
    if not a.host:
        raise UsageError("--host: must not be empty (127.0.0.1: this machine only)")
    return ServeArgs(
        model=a.model,
        hf_config=_hf_config(a.model),
        host=a.host,
        port=a.port,
        max_slots=a.max_slots,
        max_len=a.max_len,
        threads=a.threads,
        weight_version=a.weight_version,
        port_file=_port_file(a.port_file),
        max_body_mb=a.max_body_mb,
        read_timeout_s=a.read_timeout_s,
        max_conns_per_client=a.max_conns_per_client,
        api_key=api_key,
        timing=_timing(a.timing_model),
    )


def _hf_config(folder: str) -> dict[str, object]:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise InputError(f"--model {folder}: no such folder (an HF model folder is expected)")
    if not os.path.isfile(path):
        raise InputError(f"--model {folder}: no config.json (an HF model folder is expected)")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InputError(f"--model {path}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InputError(f"--model {path}: a JSON object is expected, got {type(obj).__name__}")
    return obj


def _timing(path: str | None) -> TimingConfig | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise InputError(f"--timing-model {path}: no such file")
    try:
        return TimingConfig.from_json(path)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as e:
        raise InputError(f"--timing-model {e}") from None


def _port_file(path: str | None) -> str | None:
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OutputError(f"--port-file {path}: is a folder; a file path is expected")
    if not os.path.isdir(folder):
        raise OutputError(f"--port-file {path}: its folder {folder} does not exist")
    return path


def bind(args: ServeArgs) -> EngineHTTPServer:
    """The listening server on ``--host`` / ``--port`` (its routes set later, by EngineServer);
    a port in use, a host that is not this machine's or does not resolve: the error naming it."""
    try:
        return EngineHTTPServer(
            (args.host, args.port),
            read_timeout_s=args.read_timeout_s,
            max_conns_per_client=args.max_conns_per_client,
        )
    except socket.gaierror as e:
        raise UsageError(
            f"--host {args.host}: not an IPv4 address or a name that resolves ({e.strerror})"
        ) from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ResourceError(
                f"--port {args.port}: already in use on {args.host} (another server? --port 0 picks a free one)"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {args.host}: not an address of this machine") from None
        if e.errno == errno.EACCES:
            raise ResourceError(
                f"--port {args.port}: permission denied on {args.host} (ports below 1024 need privileges)"
            ) from None
        raise ResourceError(
            f"--host {args.host} --port {args.port}: cannot listen: {e.strerror or e}"
        ) from None

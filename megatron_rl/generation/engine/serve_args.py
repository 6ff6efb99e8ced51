"""``megatron-rl serve-engine``'s arguments, every one checked before the model is loaded.

A bad argument is one line naming the flag and what is allowed (:mod:`megatron_rl.errors`):
a number out of its range or not a number (exit 2), a ``--model`` folder without a readable
``config.json`` or a ``--timing-model`` file that is missing or bad (3), a ``--port-file`` whose
folder does not exist or that would replace a file no engine server wrote -- an input of the
model's folder above all (4), a port in use (5). The listening socket is bound here too, before the
model loads, so that a port in use is reported in a second rather than after the load.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass

from megatron_rl.errors import (
    ArgumentParser,
    InputError,
    OutputError,
    ResourceError,
    UsageError,
    float_arg,
    int_arg,
)
from megatron_rl.fileio import check_output_apart, fsync_dir
from megatron_rl.generation.engine.http import (
    DEFAULT_MAX_CONNS_PER_CLIENT,
    DEFAULT_READ_TIMEOUT_S,
    EngineHTTPServer,
)
from megatron_rl.generation.engine.timing import TimingConfig
from megatron_rl.generation.protocol import API_KEY_ENV, api_key_from_env, check_api_key
from megatron_rl.hf.files import read_config_json

__all__ = ["ServeArgs", "bind", "parse_serve_args", "write_port_file"]

# Ranges of the numeric flags. The upper ends are far past any real use; they are there so that a
# typo (an extra zero or two) is refused by name rather than failing as an allocation later.
_MAX_SLOTS = 1 << 16
_MAX_LEN = 1 << 24
_MAX_THREADS = 4096
_MAX_BODY_MB = 1 << 20  # 1 TiB
_MAX_TIMEOUT_S = 86400.0
_MAX_CONNS = 1 << 20
# What a port file holds: the decimal port and nothing else (see write_port_file).
_PORT_FILE_TEXT = re.compile(rb"[0-9]{1,5}\n?")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="megatron-rl serve-engine", description="serve an HF model with the built-in engine"
    )
    p.add_argument("--model", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int_arg(0, 65535, " (0 picks a free port)"), default=30000)
    p.add_argument("--max-slots", type=int_arg(1, _MAX_SLOTS), default=16, help="sequences decoded together")
    p.add_argument(
        "--max-len", type=int_arg(2, _MAX_LEN), default=2048, help="prompt + completion tokens per slot"
    )
    p.add_argument(
        "--threads",
        type=int_arg(0, _MAX_THREADS, " (0: torch default)"),
        default=0,
        help="torch CPU threads (0: torch default)",
    )
    p.add_argument(
        "--weight-version", type=int_arg(0, 2**63 - 1), default=0, help="version of the loaded weights"
    )
    p.add_argument(
        "--port-file",
        help="write the bound port here (atomic) once serving; an existing file is replaced only "
        "when it holds a port number (an earlier server's), and never inside --model",
    )
    p.add_argument(
        "--max-body-mb",
        type=float_arg(0.0, _MAX_BODY_MB, low_open=True),
        default=64.0,
        help="largest request body read; larger: 413 unread",
    )
    p.add_argument(
        "--read-timeout-s",
        type=float_arg(0.0, _MAX_TIMEOUT_S, low_open=True),
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds a client has to send a whole request, line, headers and body together "
        "(and to take its answer); past it: 408, or closed. An idle keep-alive connection is "
        "closed after it too",
    )
    p.add_argument(
        "--max-conns-per-client",
        type=int_arg(0, _MAX_CONNS, " (0: no limit)"),
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
        port_file=_port_file(a.port_file, [a.model, a.timing_model]),
        max_body_mb=a.max_body_mb,
        read_timeout_s=a.read_timeout_s,
        max_conns_per_client=a.max_conns_per_client,
        api_key=api_key,
        timing=_timing(a.timing_model),
    )


def _hf_config(folder: str) -> dict[str, object]:
    return read_config_json(folder, flag="--model")


def _timing(path: str | None) -> TimingConfig | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise InputError(f"--timing-model {path}: no such file")
    try:
        return TimingConfig.from_json(path)
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as e:
        raise InputError(f"--timing-model {e}") from None


def _port_file(path: str | None, inputs: list[str | None]) -> str | None:
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OutputError(f"--port-file {path}: is a folder; a file path is expected")
    if not os.path.isdir(folder):
        raise OutputError(f"--port-file {path}: its folder {folder} does not exist")
    check_output_apart(path, inputs, what="--port-file")
    _check_replaceable(path)
    return path


def _check_replaceable(path: str) -> None:
    """Refuse a port file path that holds anything but an earlier server's port file: a file whose
    whole content is a port number (what :func:`write_port_file` writes; replacing it lets a
    restarted server reuse its flag). Anything else -- a symlink, a config, a file of some other
    program -- is the user's, and is never replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"--port-file {path}: exists and is not a regular file; choose another path")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise OutputError(f"--port-file {path}: exists and cannot be read ({e.strerror})") from None
    if not _PORT_FILE_TEXT.fullmatch(head):
        raise OutputError(
            f"--port-file {path}: exists and is not a port file (it would be replaced); "
            "choose another path, or remove it"
        )


def write_port_file(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically, never over a file that is not a port file: checked
    again now, since the model's load may have taken minutes. A path that is absent is claimed
    with a hard link of the written temporary file (fails if the path appeared meanwhile) rather
    than a rename over it."""
    _check_replaceable(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "x", encoding="ascii") as f:
            f.write(str(port))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError:  # it appeared meanwhile, or the file system has no hard links
            _check_replaceable(path)
            os.replace(tmp, path)
        fsync_dir(folder)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


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

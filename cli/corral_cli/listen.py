"""A check, before minutes of model loading, that the address a serving command will listen on is
free (its argparse type is `flags.port_number`); and free ports for processes started to listen later."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

from corral_cli.flags import MAX_PORT


def cannot_listen(host: str, ports: Iterable[int]) -> str | None:
    """Why the server could not listen on one of `ports` at `host` (taken, out of range, an
    address this machine does not have), or None. Binds and lets go at once, as the server will
    bind again with the same options; a process taking the port in between still fails then."""
    for port in ports:
        if not 1 <= port <= MAX_PORT:
            return f"port {port} is outside 1-{MAX_PORT}"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                sock.bind((host, port))
            except OSError as e:
                return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORTS = random.Random()


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range is 32768-60999


def _is_unused(host: str, port: int) -> bool:
    """Bindable without SO_REUSEADDR: free for any server, whatever options it binds with."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(host: str, count: int) -> list[int]:
    """`count` consecutive ports free on `host`, below the kernel's ephemeral range.

    The process given them binds them later (an engine, after loading its model). A port-0 pick is
    an ephemeral port, which in that gap the kernel can hand to any outgoing connection on the
    machine (another engine's gloo connections, a health poll) and the listen then fails with
    "address already in use"; ports below the range are only ever taken by asking for them."""
    top = _first_ephemeral_port()
    for _ in range(1000):
        base = _PORTS.randrange(max(1024, top - 12000), top - count + 1)
        if all(_is_unused(host, port) for port in range(base, base + count)):
            return list(range(base, base + count))
    raise RuntimeError(f"found no {count} consecutive free ports on {host} below {top}")

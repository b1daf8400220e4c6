"""A check, before minutes of model loading, that the address a serving command will listen on is
free (its argparse type is `flags.port_number`)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

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

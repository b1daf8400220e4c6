"""Ports the serving commands listen on: an argparse type that refuses one outside 1-65535, and a
check, before minutes of model loading, that the address is free."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterable

MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535 (the OS would take 70000 as 4464)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 1 to {MAX_PORT}, got {port}")
    return port


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

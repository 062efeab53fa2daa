"""Free loopback ports for tests that start servers."""

from __future__ import annotations

import socket


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (checked, then released)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range")

"""Free loopback ports for tests that start servers."""

from __future__ import annotations

import random
import socket

from dcp_otel.demo import ephemeral_range


def _regions(count: int) -> list[tuple[int, int]]:
    """Port ranges [start, end) outside the kernel's ephemeral range with room for ``count`` ports.

    A port handed to a child process to bind later must not be in that range: meanwhile the kernel may
    give it to any outgoing connection as its local port (gloo's, the store's, an exporter's), and the
    child's server then finds it taken.
    """
    low, high = ephemeral_range()
    regions = [(10_000, low), (high + 1, 65_536)]
    return [(start, end) for start, end in regions if end - start > count] or [(1024, 65_536)]


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (checked, then released), outside the
    ephemeral range (see :func:`_regions`)."""
    regions = _regions(count)
    for _ in range(200):
        start, end = random.choice(regions)
        base = random.randrange(start, end - count + 1)
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

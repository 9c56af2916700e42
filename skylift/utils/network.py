"""Addresses between hosts: which local address reaches a peer, and which interface holds it.

Rendezvous across machines (the training ranks' process group, the weight-update group) must
bind and advertise an address the peers can reach, never 127.0.0.1 unless every peer is on this
host. Nothing here sends a packet: connecting a UDP socket only asks the kernel for a route.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    """The host of `http://host:port/...` or of a bare `host:port`."""
    parsed = urlsplit(url if "://" in url else f"http://{url}")
    if not parsed.hostname:
        raise ValueError(f"no host in {url!r}")
    return parsed.hostname


def route_address(peer: str) -> str:
    """The local IPv4 address this host uses to reach `peer` (a host name or an IP).

    Loopback peers give 127.0.0.1. Raises `OSError` naming the peer when there is no route.
    """
    if is_loopback(peer):
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))  # UDP: no packet is sent, the kernel only picks the route
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise OSError(f"no route from this host to {peer}: {exc}") from exc


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` (None when no interface does)."""
    if is_loopback(address):
        return "lo"
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None

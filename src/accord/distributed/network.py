"""Which network this machine reaches another by: the interface gloo binds to, and whether an
address is this machine's own or a loopback one. Used when the process group forms (under any
launcher) and by accord's multi-node launcher; the standard library only.
"""

from __future__ import annotations

import socket
import struct

from accord.errors import UserInputError


class ClusterError(UserInputError):
    """Inconsistent multi-node settings; the message says which and how to fix them."""


def interface_towards(host: str) -> tuple[str | None, str | None]:
    """(interface name, local address) this machine uses to reach `host`, so gloo binds to
    the network the other nodes can reach (else it picks the hostname's address, often
    127.0.0.1, and the other node's connections are refused)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only selects the route
            local = probe.getsockname()[0]
    except OSError:
        return None, None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name, local
    return None, local


def _ipv4_of(interface: str) -> str | None:
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def is_local_address(host: str) -> bool:
    """Does `host` name this machine (so its launcher hosts the c10d rendezvous store)?"""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return False
    if target.startswith("127."):
        return True
    return any(_ipv4_of(name) == target for _, name in socket.if_nameindex())


def is_loopback(host: str) -> bool:
    """Does `host` resolve to a loopback address (localhost, or a host name that /etc/hosts
    maps to 127.0.1.1 as many distributions do)? Other machines cannot reach it."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)

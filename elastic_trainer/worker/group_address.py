"""Which network interface a worker's process groups bind to: the one holding its Ray node's address.

Left to itself, gloo takes the address the host's name resolves to. Many hosts
resolve their own name to a loopback address (Debian's default is 127.0.1.1),
so gloo advertised 127.0.0.1 to peers on other hosts, and the first set-up
failed ("Gloo connectFullMesh failed ... remote=[127.0.0.1]:..., Connection
refused"). Ray's node address is the one every other node already reaches this
host at, so the groups use its interface, on every backend. A user's own
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (``scaling.env_vars``) wins.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` on this host, None where none does
    (or the address is not IPv4)."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address on it
                continue
            if got[20:24] == packed:
                return name
    return None


def bind_groups_to(address: str, environ=None) -> dict[str, str]:
    """Set each of ``VARS`` the environment does not already set to the interface of ``address``
    (read when a group is built). Returns what it set: nothing where the user set both, or where
    no interface holds the address."""
    env = os.environ if environ is None else environ
    name = interface_of(address)
    if name is None:
        return {}
    made = {var: name for var in VARS if not env.get(var)}
    env.update(made)
    return made

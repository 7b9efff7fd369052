"""The lab's network: one bridge, and per host a network namespace joined to it by a veth pair.

Addresses come only from 198.18.0.0/15 (RFC 2544's range for network
benchmarks), one /24 of it per lab. The bridge has no address of its own and
nothing is routed: a host reaches the other hosts on the bridge and nothing
else, and the machine's own namespace does not reach the lab.

A link's rate cap is a token bucket (``tc ... tbf``) on both ends of the
host's veth, so each direction is capped. This kernel has no ``netem``: no
latency or loss is injected, only rates.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess

LAB_NET = ipaddress.ip_network("198.18.0.0/15")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command; its stderr is in the error where it fails."""
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of 198.18.0.0/15 that no interface of this namespace has an address in."""
    used = []
    for link in json.loads(sh("ip", "-j", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for sub in LAB_NET.subnets(new_prefix=24):
        if not any(sub.overlaps(u) for u in used):
            return sub
    raise RuntimeError("every /24 of 198.18.0.0/15 is in use on this machine")


def make_bridge(name: str) -> None:
    sh("ip", "link", "add", name, "type", "bridge")
    sh("ip", "link", "set", name, "up")


def make_host_netns(ns: str, bridge: str, veth: str, address: str, prefixlen: int) -> None:
    """Namespace ``ns`` with ``eth0`` at ``address``, its peer ``veth`` on ``bridge``; loopback up.
    No default route: only the lab's /24 is reachable from it."""
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", veth, "master", bridge, "up")
    sh("ip", "-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")


def set_link(veth: str, up: bool) -> None:
    """Cut (down) or heal (up) a host's link from the bridge's side. A cut closes no socket: the
    host's peers see silence, as with a pulled cable or a partition."""
    sh("ip", "link", "set", veth, "up" if up else "down")


def cap_rate(ns: str, veth: str, mbit: float | None) -> None:
    """Cap the host's link at ``mbit`` Mbit/s each way (None: lift the cap)."""
    for where in (("ip", "netns", "exec", ns, "tc"), ("tc",)):
        dev = "eth0" if len(where) > 1 else veth
        sh(*where, "qdisc", "del", "dev", dev, "root", check=False)
        if mbit:
            # A burst of a few ms of traffic at the rate, at least 64 KiB: smaller bursts cap a
            # gigabit link below its rate on a busy host (the bucket empties between timer ticks).
            burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))
            sh(*where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
               "burst", str(burst), "latency", "50ms")


def delete_netns(ns: str) -> None:
    sh("ip", "netns", "del", ns, check=False)


def delete_link(name: str) -> None:
    sh("ip", "link", "del", name, check=False)


def lab_netns(prefix: str) -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip() and line.split()[0].startswith(prefix)]


def lab_links(prefix: str) -> list[str]:
    return [link["ifname"] for link in json.loads(sh("ip", "-j", "link").stdout or "[]")
            if link["ifname"].startswith(prefix)]

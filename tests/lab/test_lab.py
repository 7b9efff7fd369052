"""The lab itself: hosts with their own addresses on a bridge and nothing beyond, links that cut,
heal and cap, cgroups that freeze and kill, and a teardown that leaves nothing behind, also when
the code inside fails or the process is told to stop."""

import ipaddress
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lab import Lab, leftovers, missing, wait_until
from lab.net import LAB_NET, sh

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

LISTEN = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 7000)); s.listen(8)
    while True:
        c, _ = s.accept(); c.sendall(b"hi"); c.close()
""")
CONNECT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
        print("GOT", c.recv(2).decode())
    except OSError as e:
        print("FAILED", type(e).__name__)
""")


def reach(lab, src, dst, timeout_s=1.0) -> str:
    p = lab.spawn(src, [sys.executable, "-c", CONNECT, dst.address, str(timeout_s)], log="connect")
    p.wait(timeout=timeout_s + 30)
    return (src.dir / "connect.log").read_text().strip().splitlines()[-1]


def test_hosts_links_and_cgroups_do_what_they_say_and_nothing_is_left():
    with Lab(hosts=3, cpus_per_host=0.3, memory_gb=0.5, link_mbit=200) as lab:
        h0, h1, h2 = lab.hosts
        addrs = [ipaddress.ip_address(h.address) for h in lab.hosts]
        assert all(a in LAB_NET for a in addrs) and len(set(addrs)) == 3
        # Only the lab's /24, on the bridge: no default route out of a host.
        for h in lab.hosts:
            routes = sh("ip", "-n", h.ns, "route").stdout
            assert "default" not in routes and str(lab.subnet) in routes, routes
        # A rate cap on both ends of each link.
        assert "tbf" in sh("tc", "qdisc", "show", "dev", h1.veth).stdout
        assert "tbf" in sh("ip", "netns", "exec", h1.ns, "tc", "qdisc", "show", "dev", "eth0").stdout
        lab.spawn(h0, [sys.executable, "-c", LISTEN, h0.address], log="listen")
        wait_until(lambda: reach(lab, h1, h0).startswith("GOT"), 30, "h1 reaching h0's listener")
        # Cut: h1 hears nothing (a timeout, not a refusal); healed: it does again.
        lab.cut(h1)
        assert reach(lab, h1, h0, 0.5) == "FAILED TimeoutError"
        lab.heal(h1)
        wait_until(lambda: reach(lab, h1, h0).startswith("GOT"), 30, "h1 reaching h0 once healed")
        # Freeze stops a host's processes where they stand; kill ends every one of them.
        busy = lab.spawn(h2, [sys.executable, "-c", "while True: pass"], log="busy")
        wait_until(lambda: _cpu_ticks(busy.pid) > 0, 30, "the busy loop running in h2")
        lab.freeze(h2)
        frozen = _cpu_ticks(busy.pid)
        time.sleep(0.3)   # a frozen process gets no CPU: nothing to wait on but time
        assert _cpu_ticks(busy.pid) == frozen
        lab.thaw(h2)
        wait_until(lambda: _cpu_ticks(busy.pid) > frozen, 30, "the busy loop running again once thawed")
        assert lab.kill(h2) >= 1
        assert busy.wait(timeout=10) == -signal.SIGKILL and h2.group.pids() == []
        assert any(leftovers(lab.id).values())
        lab_id = lab.id
    assert leftovers(lab_id) == {"netns": [], "links": [], "cgroups": [], "processes": []}


def test_nothing_is_left_when_the_code_inside_fails():
    with pytest.raises(RuntimeError, match="inside"):
        with Lab(hosts=2, cpus_per_host=0.2) as lab:
            lab.spawn(lab.hosts[1], ["sleep", "600"], log="sleep")
            lab_id = lab.id
            raise RuntimeError("inside")
    assert leftovers(lab_id) == {"netns": [], "links": [], "cgroups": [], "processes": []}


def test_nothing_is_left_when_the_process_is_told_to_stop():
    # A lab in another process, stopped by SIGTERM (as a CI runner or pytest-timeout's kill
    # would stop it) and by Ctrl-C (SIGINT), while its hosts run.
    # The child starts from the signals' defaults: it inherits an ignored or blocked signal from
    # the suite's process, where one of the earlier tests may have left one (this test timed out
    # in two full runs and never alone).
    code = textwrap.dedent("""
        import signal, sys, time
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, sys.argv[1])
        from lab import Lab
        with Lab(hosts=2, cpus_per_host=0.2) as lab:
            lab.spawn(lab.hosts[1], ["sleep", "600"], log="sleep")
            print(lab.id, flush=True)
            time.sleep(600)
    """)
    import pathlib
    repo = str(pathlib.Path(__file__).resolve().parents[2])
    for sig in (signal.SIGTERM, signal.SIGINT):
        p = subprocess.Popen([sys.executable, "-c", code, repo], stdout=subprocess.PIPE, text=True)
        lab_id = p.stdout.readline().strip()
        assert lab_id and any(leftovers(lab_id).values())
        p.send_signal(sig)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"the lab process outlived {sig.name} by 60 s; this process: SIGTERM "
                                 f"{signal.getsignal(signal.SIGTERM)}, SIGINT {signal.getsignal(signal.SIGINT)}, "
                                 f"blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}") from None
        assert leftovers(lab_id) == {"netns": [], "links": [], "cgroups": [], "processes": []}, sig


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (/proc/<pid>/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])

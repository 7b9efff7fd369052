"""Groups bind to the interface of the Ray node's address (worker.group_address); a remote
error is named by its cause (errors.error_line)."""

import shutil
import subprocess
import sys

import pytest
import ray

from elastic_trainer.errors import error_line
from elastic_trainer.worker.group_address import bind_groups_to, interface_of


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads interfaces by Linux's ioctl")
def test_the_interface_holding_an_address_is_found_and_set_where_the_user_set_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.19.255.254") is None and interface_of("not an address") is None
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert bind_groups_to("127.0.0.1", env) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}   # the user's stays
    env = {}
    assert bind_groups_to("198.19.255.254", env) == {} and env == {}   # held by no interface here


@pytest.mark.skipif(shutil.which("ip") is None, reason="checked against iproute2's own listing")
def test_every_primary_address_of_this_host_maps_to_its_interface_as_ip_lists_it():
    listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    first = {}
    for line in listed.splitlines():   # "1: lo    inet 127.0.0.1/8 scope host lo ..."
        parts = line.split()
        first.setdefault(parts[1], parts[3].split("/")[0])   # an interface's first is its primary
    assert first
    for name, address in first.items():
        assert interface_of(address) == name, (address, listed)


def test_a_remote_error_is_named_by_its_cause_not_by_where_it_ran():
    cause = RuntimeError("Gloo connectFullMesh failed ... remote=[127.0.0.1]:54176\nsecond line")
    remote = ray.exceptions.RayTaskError("TrainWorker.setup", "Traceback ...", cause).as_instanceof_cause()
    assert error_line(remote) == "RuntimeError: Gloo connectFullMesh failed ... remote=[127.0.0.1]:54176"
    assert error_line(ValueError("")) == "ValueError"

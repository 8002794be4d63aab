"""The network address a worker's collectives use: the interface that routes to the coordinator,
or the one `LOCKSTEP_SOCKET_IFNAME` names.

JAX's CPU collectives (gloo) otherwise advertise whatever this machine's host name resolves to.
Debian's and many containers' `/etc/hosts` map the host name to a loopback address (127.0.1.1 or
127.0.0.1), and a peer on another node then tries to connect to itself ("Connection refused,
remote=[127.0.0.1]"). A worker instead finds the local address from which the coordinator is
reached (the kernel's route to it, as `ip route get` shows), and gives that address to gloo; on
GPUs, NCCL gets the interface's name (`NCCL_SOCKET_IFNAME`) unless it is set already.

A coordinator on a loopback address (127.0.0.1, localhost) puts every node on this machine (the
launchers of a test, say), where a loopback address is right:

>>> choose("127.0.0.1:29500", nodes=2, env={}).address
'127.0.0.1'
>>> choose("10.0.0.1:29500", nodes=2, env={"LOCKSTEP_SOCKET_IFNAME": "lo"})
Traceback (most recent call last):
...
lockstep._errors.UsageError: the job spans 2 nodes, but this worker's address for the collectives is the loopback address 127.0.0.1 (from LOCKSTEP_SOCKET_IFNAME=lo): the other nodes cannot reach it. Give --coordinator (LOCKSTEP_COORDINATOR_ADDRESS) an address of node 0 that the other nodes reach, or name the network interface with --socket-ifname (LOCKSTEP_SOCKET_IFNAME).
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import json
import os
import socket
import struct
from collections.abc import Mapping

from .._errors import UsageError

IFNAME_VARIABLE = "LOCKSTEP_SOCKET_IFNAME"
NODES_VARIABLE = "LOCKSTEP_NNODES"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclasses.dataclass(frozen=True)
class Transport:
    """Where this worker's collectives listen: `address` (IPv4), on `interface` (None if not found),
    and how it was chosen (for messages)."""

    address: str
    interface: str | None
    how: str


def interfaces() -> list[str]:
    """This machine's network interfaces by name (`lo`, `eth0`, ...)."""
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str | None:
    """The IPv4 address of the interface `name`, or None if it has none (or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface that holds `address`, or None."""
    return next((name for name in interfaces() if interface_address(name) == address), None)


def route_to(host: str, port: int) -> str:
    """The local IPv4 address of the route to `host` (no packet is sent: a UDP socket is connected)."""
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve the coordinator's host {host!r}: {e.strerror}.") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(target)
        except OSError as e:
            raise UsageError(f"no route to the coordinator {host}:{port} from this machine: {e.strerror}; name the "
                             f"network interface with --socket-ifname ({IFNAME_VARIABLE}).") from None
        return str(s.getsockname()[0])


def nodes_in_job(env: Mapping[str, str]) -> int | None:
    """How many nodes (machines) the job spans, where the launcher, SLURM or TF_CONFIG says: None if unknown."""
    for name in (NODES_VARIABLE, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(name, "").isdigit():
            return int(env[name])
    try:
        cluster = json.loads(env["TF_CONFIG"])["cluster"]
        return len({str(a).rsplit(":", 1)[0] for kind in ("chief", "worker") for a in cluster.get(kind, [])})
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def _is_loopback_host(host: str) -> bool:
    """`host` names this machine only: "localhost" or a loopback address written out."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose(coordinator_address: str, nodes: int | None = None, env: Mapping[str, str] | None = None) -> Transport:
    """The address this worker's collectives use (see the module's text).

    Raises:
      UsageError: `LOCKSTEP_SOCKET_IFNAME` names no interface with an IPv4 address; or the address is
        a loopback address while the job spans several nodes and the coordinator is not on a
        loopback address (a host name that resolves to 127.0.1.1 on node 0, say).
    """
    env = os.environ if env is None else env
    host, _, port = coordinator_address.rpartition(":")
    host = host.strip("[]")
    name = env.get(IFNAME_VARIABLE, "").strip()
    if name:
        address = interface_address(name)
        if address is None:
            raise UsageError(f"{IFNAME_VARIABLE} (--socket-ifname) is {name!r}, but this machine has no such network "
                             f"interface with an IPv4 address; its interfaces: {', '.join(interfaces())}.")
        transport = Transport(address, name, f"{IFNAME_VARIABLE}={name}")
    else:
        address = route_to(host, int(port) if port.isdigit() else 0)
        transport = Transport(address, interface_of(address), f"the route to the coordinator {host}")
    if nodes is None:
        nodes = nodes_in_job(env)
    if (nodes is not None and nodes > 1 and ipaddress.ip_address(transport.address).is_loopback
            and not _is_loopback_host(host)):
        raise UsageError(
            f"the job spans {nodes} nodes, but this worker's address for the collectives is the loopback address "
            f"{transport.address} (from {transport.how}): the other nodes cannot reach it. Give --coordinator "
            "(LOCKSTEP_COORDINATOR_ADDRESS) an address of node 0 that the other nodes reach, or name the network "
            f"interface with --socket-ifname ({IFNAME_VARIABLE}).")
    return transport


def install(transport: Transport) -> None:
    """Makes JAX's CPU collectives (gloo) listen on `transport.address`, and NCCL use its interface
    unless `NCCL_SOCKET_IFNAME` is set. Call after `jax.distributed.initialize`, before JAX's CPU
    backend starts."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    if transport.interface and not ipaddress.ip_address(transport.address).is_loopback:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", transport.interface)
    import jax

    if jax.config.jax_cpu_collectives_implementation not in (None, "gloo"):
        return  # MPI (or another transport) chosen by the user: it finds its own peers

    def make_cpu_client():  # as JAX's own factory, with gloo's address given
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=transport.address)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)

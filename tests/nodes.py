"""Several nodes on one machine, for the multi-node tests: `Nodes(n)` creates `n` Linux network
namespaces (node k at 10.77.0.(k+1)), each joined by a veth link to a bridge in a hub namespace,
starts commands in them, takes a node's link down and up, and at exit kills what it started and
deletes every namespace and link it made (then checks that no namespace, and no process in one,
was left).

Each node's `/etc/hosts` maps the host name to 127.0.1.1 by default, as Debian's and many
containers' do (`ip netns exec` reads it from /etc/netns/<name>/hosts): the host name of a node
then resolves to a loopback address, never to the node's address on the link. The names `node0`,
`node1`, ... resolve to the nodes' addresses, as a cluster's DNS would.

Needs root and iproute2 (`ip`); `skip_reason()` says why not where they are missing.
"""

import os
import pathlib
import shutil
import signal
import subprocess
import time

PREFIX = f"lsn{os.getpid() % 100000}"  # names unique to this test process: at most 15 characters a link
SUBNET = "10.77.0"


def skip_reason():
    """Why multi-node tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "multi-node tests need root (they create network namespaces)"
    if shutil.which("ip") is None:
        return "multi-node tests need iproute2's `ip` command"
    probe = f"{PREFIX}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def leftovers():
    """This test process's namespaces still there, and its /etc/netns directories."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    netns = pathlib.Path("/etc/netns")
    dirs = [p.name for p in netns.iterdir()] if netns.is_dir() else []
    return sorted({n for n in names + dirs if n.startswith(PREFIX)})


class Nodes:
    """`n` nodes joined by one bridge. `address(k)` is node k's address; `run(k, cmd)` starts
    `cmd` in node k (a `subprocess.Popen`, output captured as text); `link(k, up)` takes node k's
    link down or up; `hosts` is what each node's /etc/hosts maps the host name to: "loopback"
    (127.0.1.1) or "own" (the node's own address)."""

    def __init__(self, n, hosts="loopback"):
        self.n, self.hosts = n, hosts
        self.hub = f"{PREFIX}h"
        self.names = [f"{PREFIX}n{k}" for k in range(n)]
        self.procs = []
        self.orphans = []  # processes still alive in a node after its launcher was killed

    def address(self, k):
        return f"{SUBNET}.{k + 1}"

    def __enter__(self):
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            n = self.n
            for k, name in enumerate(self.names):
                _ip("netns", "add", name)
                inner, outer = f"{PREFIX}a{k}", f"{PREFIX}b{k}"
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", inner, "netns", name)
                _ip("link", "set", outer, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", outer, "master", "br0")
                _ip("-n", self.hub, "link", "set", outer, "up")
                _ip("-n", name, "link", "set", inner, "name", "eth0")
                _ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
                etc = pathlib.Path("/etc/netns") / name
                etc.mkdir(parents=True, exist_ok=True)
                mine = "127.0.1.1" if self.hosts == "loopback" else self.address(k)
                hostname = os.uname().nodename
                names = "".join(f"{self.address(j)} node{j}\n" for j in range(n))  # as a cluster's DNS would
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{mine} {hostname}\n{names}")
        except BaseException:
            self.close()
            raise
        return self

    def run(self, k, cmd, env=None):
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[k], *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def link(self, k, up):
        _ip("-n", self.names[k], "link", "set", "eth0", "up" if up else "down")

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self.orphans = self._reap()
        for name in [*self.names, self.hub]:  # deleting a namespace deletes the links in it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(pathlib.Path("/etc/netns") / name, ignore_errors=True)
        deadline = time.monotonic() + 5
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _pids(self):
        pids = []
        for name in self.names:
            found = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            pids += [int(p) for p in found]
        return pids

    def _reap(self, grace=10.0):
        """The processes left in the nodes once the commands started there were killed (the
        workers die with their launcher), after `grace` s; kills them."""
        deadline = time.monotonic() + grace
        while self._pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self._pids()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def __exit__(self, *exc):
        self.close()
        left = leftovers()
        assert not left, f"namespaces left behind: {left}"
        assert not self.orphans, f"processes left behind in the nodes: {self.orphans}"

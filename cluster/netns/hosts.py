"""Test hosts on this machine: network namespaces with their own addresses, a router between them that can
delay, jitter and drop real packets, and a Ray node in each (as root; Debian's iproute2).

    with test_hosts(3, one_way_ms=1.0) as hosts:      # RTT 2 ms between any two hosts
        hosts.ray.start()                             # head in host 1, a worker node in each other host
        ... PUT the Serve config to hosts.dashboard_url, talk to hosts.http_url / hosts.grpc_target ...

Layout (docs/deploy.md, "Across real hosts"): host i is namespace ``<prefix>-<i>`` with address 10.213.i.2 on a
veth pair to the router namespace ``<prefix>-r`` (10.213.i.1). The router forwards between the hosts; with a
delay set, policy rules send every packet arriving from a host through the TUN device ``hsdelay``, where
``cluster/netns/delay.py`` holds it for the one-way delay before the kernel routes it on. (A bridge would
switch the hosts' frames inside the kernel, where no program can hold them: hence a router.) This process, in
the machine's own namespace, reaches host 1 (the head) alone, over a direct link 10.213.100.1 <->
10.213.100.2 that does not pass the router: the clients' and the deploy's traffic carry no added delay.
Every address is inside these namespaces; teardown ends every process in them, by id, and deletes them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from cluster.netns.delay import DelaySettings

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.213"
CLIENT_LINK = (f"{SUBNET}.100.1", f"{SUBNET}.100.2")  # this namespace's end, the head's end
TUN = "hsdelay"
DELAY_TABLE = 213
ECHO_PORT = 7777
ECHO_SERVER = f"""
import socket, sys
server = socket.create_server((sys.argv[1], {ECHO_PORT}))
print("ready", flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""
ECHO_CLIENT = f"""
import socket, statistics, sys, time
conn = socket.create_connection((sys.argv[1], {ECHO_PORT}))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    conn.sendall(bytes(64))
    got = 0
    while got < 64:
        got += len(conn.recv(64 - got))
    times.append((time.perf_counter() - start) * 1000)
print(statistics.median(times))
"""
SINK_SERVER = f"""
import socket, sys
server = socket.create_server((sys.argv[1], {ECHO_PORT}))
print("ready", flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
"""
SOURCE_CLIENT = f"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], {ECHO_PORT}))
chunk, total = bytes(1 << 16), int(sys.argv[2]) << 20
start = time.perf_counter()
for _ in range(total // len(chunk)):
    conn.sendall(chunk)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(total / (time.perf_counter() - start) / 1e6)
"""
RAY_PORT, DASHBOARD_PORT, METRICS_PORT, HTTP_PORT, GRPC_PORT = 6379, 8265, 8080, 8000, 9000


def sh(*argv: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    return subprocess.run(command, check=check, capture_output=True, text=True)


def namespaces_can_be_made() -> str | None:
    """None where this process can make network namespaces, else why not (for a test's skip message)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        return "iproute2's `ip` is not installed"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing"
    return None


def end_processes_in(netns: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process inside ``netns`` (all started by this module)."""
    def pids() -> list[int]:
        listed = sh("ip", "netns", "pids", netns, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not pids():
            return


@dataclass(frozen=True)
class Host:
    index: int  # 1-based; host 1 runs the Ray head
    netns: str
    address: str  # its address towards the other hosts
    router_end: str  # the router's address on its link
    router_link: str  # the router's end of its veth pair (down: the host is cut off)


@dataclass
class Network:
    """``count`` host namespaces and a router namespace; ``one_way_ms`` None: the router forwards in the kernel
    (no forwarder at all), a number: every packet between hosts passes the delay forwarder."""

    count: int = 3
    prefix: str = "hetspec"
    one_way_ms: float | None = 0.0
    workdir: Path = Path("/tmp/hsn")
    hosts: list[Host] = field(default_factory=list)

    @property
    def router(self) -> str:
        return f"{self.prefix}-r"

    @property
    def settings_path(self) -> Path:
        return self.workdir / "delay.json"

    @property
    def wire_path(self) -> Path:
        return self.workdir / "wire.json"

    def wire_bytes(self) -> dict[tuple[str, str], int]:
        """IP bytes offered to the wire so far, per (source, destination) address (0.1 s old at most)."""
        counted = json.loads(self.wire_path.read_text()) if self.wire_path.exists() else {}
        return {tuple(key.split(">")): value[1] for key, value in counted.items()}

    def namespaces(self) -> list[str]:
        return [self.router, *(f"{self.prefix}-{i}" for i in range(1, self.count + 1))]

    def create(self) -> None:
        self.destroy()  # what a killed earlier run left behind (same names: ours)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for netns in self.namespaces():
            sh("ip", "netns", "add", netns)
            sh("ip", "link", "set", "lo", "up", netns=netns)
        for name in ("ip_forward", "conf/all/rp_filter", "conf/default/rp_filter"):
            value = "1" if name == "ip_forward" else "0"
            sh("sysctl", "-qw", f"net.ipv4.{name.replace('/', '.')}={value}", netns=self.router)
        for i in range(1, self.count + 1):
            host = Host(i, f"{self.prefix}-{i}", f"{SUBNET}.{i}.2", f"{SUBNET}.{i}.1", f"hsr{i}")
            sh("ip", "link", "add", host.router_link, "netns", self.router, "type", "veth", "peer", "name", "eth0",
               "netns", host.netns)
            sh("ip", "addr", "add", f"{host.router_end}/24", "dev", host.router_link, netns=self.router)
            sh("ip", "link", "set", host.router_link, "up", netns=self.router)
            sh("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
            sh("ip", "link", "set", "eth0", "up", netns=host.netns)
            sh("ip", "route", "add", "default", "via", host.router_end, netns=host.netns)
            self.hosts.append(host)
        head = self.hosts[0]
        sh("ip", "link", "add", "hsclient", "type", "veth", "peer", "name", "client", "netns", head.netns)
        sh("ip", "addr", "add", f"{CLIENT_LINK[0]}/24", "dev", "hsclient")
        sh("ip", "link", "set", "hsclient", "up")
        sh("ip", "addr", "add", f"{CLIENT_LINK[1]}/24", "dev", "client", netns=head.netns)
        sh("ip", "link", "set", "client", "up", netns=head.netns)
        if self.one_way_ms is not None:
            self._start_forwarder()

    def _start_forwarder(self) -> None:
        sh("ip", "tuntap", "add", "dev", TUN, "mode", "tun", netns=self.router)
        sh("ip", "link", "set", TUN, "up", netns=self.router)
        sh("sysctl", "-qw", f"net.ipv4.conf.{TUN}.rp_filter=0", netns=self.router)
        sh("ip", "route", "add", "default", "dev", TUN, "table", str(DELAY_TABLE), netns=self.router)
        for host in self.hosts:  # from a host's link into the forwarder; back out of it by the main table
            sh("ip", "rule", "add", "iif", host.router_link, "lookup", str(DELAY_TABLE), "pref", "100",
               netns=self.router)
        self.set_delay(DelaySettings(one_way_ms=self.one_way_ms or 0.0))
        log = open(self.workdir / "forwarder.log", "w")
        subprocess.Popen(["ip", "netns", "exec", self.router, sys.executable, "-m", "cluster.netns.delay",
                          "--device", TUN, "--settings", str(self.settings_path), "--wire", str(self.wire_path)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log)

    def set_delay(self, settings: DelaySettings) -> None:
        """Takes effect within 0.1 s (the forwarder re-reads the file)."""
        if self.one_way_ms is None:
            raise RuntimeError("this network was made without the delay forwarder")
        settings.write(self.settings_path)

    def cut(self, host: Host, cut: bool = True) -> None:
        """Take ``host``'s link down (its packets are lost, as with a pulled cable) or bring it back."""
        sh("ip", "link", "set", host.router_link, "down" if cut else "up", netns=self.router)

    def rtt_ms(self, source: Host, destination: Host, count: int = 20) -> float:
        """The median round-trip time of a 64-byte TCP message from ``source`` to ``destination`` over the
        router (an echo server in ``destination``; no ping on this machine)."""
        server = subprocess.Popen(["ip", "netns", "exec", destination.netns, sys.executable, "-c", ECHO_SERVER,
                                   destination.address], stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            out = sh(sys.executable, "-c", ECHO_CLIENT, destination.address, str(count), netns=source.netns).stdout
            return float(out)
        finally:
            server.kill()
            server.wait()

    def throughput_mb_s(self, source: Host, destination: Host, megabytes: int = 200) -> float:
        """MB/s of one TCP stream from ``source`` to ``destination`` over the router."""
        server = subprocess.Popen(["ip", "netns", "exec", destination.netns, sys.executable, "-c", SINK_SERVER,
                                   destination.address], stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()  # "ready"
            out = sh(sys.executable, "-c", SOURCE_CLIENT, destination.address, str(megabytes),
                     netns=source.netns).stdout
            return float(out)
        finally:
            server.kill()
            server.wait()

    def destroy(self) -> None:
        listed = sh("ip", "netns", "list", check=False).stdout
        existing = {line.split()[0] for line in listed.splitlines() if line.strip()}
        for netns in self.namespaces():
            if netns in existing:
                end_processes_in(netns)
                sh("ip", "netns", "del", netns, check=False)
        sh("ip", "link", "del", "hsclient", check=False)  # gone with the head's namespace; an orphan otherwise
        self.hosts = []


@dataclass
class RayNodes:
    """A Ray head in host 1 and a worker node in each other host, each offering ``host_<i>: 1``."""

    network: Network
    num_cpus: int = 1
    object_store_bytes: int = 200 * 1024 * 1024
    env: dict = field(default_factory=dict)

    @property
    def head(self) -> Host:
        return self.network.hosts[0]

    def _environment(self) -> dict:
        return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
                **self.env}

    def start_node(self, host: Host) -> None:
        head = host.index == 1
        argv = [str(Path(sys.executable).parent / "ray"), "start", "--node-ip-address", host.address, "--num-cpus", str(self.num_cpus),
                "--resources", json.dumps({f"host_{host.index}": 1.0}),
                "--object-store-memory", str(self.object_store_bytes), "--metrics-export-port", str(METRICS_PORT),
                "--temp-dir", str(self.network.workdir / f"ray{host.index}"), "--disable-usage-stats"]
        if head:
            argv += ["--head", "--port", str(RAY_PORT), "--dashboard-host", "0.0.0.0",
                     "--dashboard-port", str(DASHBOARD_PORT)]
        else:
            argv += ["--address", f"{self.head.address}:{RAY_PORT}"]
        done = subprocess.run(["ip", "netns", "exec", host.netns, *argv], cwd=REPO, env=self._environment(),
                              capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start in {host.netns} failed: {done.stderr[-2000:]}")

    def start(self) -> None:
        for host in self.network.hosts:
            self.start_node(host)
        self.wait_for_nodes(len(self.network.hosts))

    def kill_node(self, host: Host) -> None:
        """Every Ray process of ``host`` killed at once (SIGKILL: a machine lost, not a clean stop)."""
        end_processes_in(host.netns, grace_s=0.0)

    def alive_nodes(self) -> list[dict]:
        import httpx

        nodes = httpx.get(f"{dashboard_url()}/nodes?view=summary", timeout=10).json()["data"]["summary"]
        return [node for node in nodes if node["raylet"]["state"] == "ALIVE"]

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if len(self.alive_nodes()) >= count:
                    return
            except Exception:  # noqa: BLE001 -- the dashboard is still starting
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} Ray nodes alive after {timeout_s} s")
            time.sleep(1.0)


def dashboard_url() -> str:
    return f"http://{CLIENT_LINK[1]}:{DASHBOARD_PORT}"


def http_url() -> str:
    return f"http://{CLIENT_LINK[1]}:{HTTP_PORT}"


def grpc_target() -> str:
    return f"{CLIENT_LINK[1]}:{GRPC_PORT}"


@dataclass
class TestHosts:
    network: Network
    ray: RayNodes
    dashboard_url: str = field(default_factory=dashboard_url)
    http_url: str = field(default_factory=http_url)
    grpc_target: str = field(default_factory=grpc_target)

    __test__ = False  # not a pytest class


@contextmanager
def test_hosts(count: int = 3, one_way_ms: float | None = 0.0, prefix: str = "hetspec",
               workdir: Path = Path("/tmp/hsn"), num_cpus: int = 1, env: dict | None = None
               ) -> Iterator[TestHosts]:
    """``count`` hosts behind the router; Ray is started by the caller (``hosts.ray.start()``). Everything is
    torn down on exit, after a failure too."""
    network = Network(count, prefix, one_way_ms, workdir)
    try:
        network.create()
        yield TestHosts(network, RayNodes(network, num_cpus=num_cpus, env=env or {}))
    finally:
        network.destroy()


test_hosts.__test__ = False


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Make the test hosts (and Ray on them) until interrupted.")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, default=None, help="RTT between hosts (none: no forwarder)")
    parser.add_argument("--ray", action="store_true", help="start a Ray node in each host")
    parser.add_argument("--measure", action="store_true", help="print the link's RTT and TCP throughput with "
                        "the kernel routing and through the forwarder at 0 ms, then exit")
    args = parser.parse_args(argv)
    if args.measure:
        for one_way in (None, 0.0):
            with test_hosts(args.hosts, one_way) as hosts:
                _, source, destination = hosts.network.hosts
                print(f"{'kernel routing' if one_way is None else 'forwarder, 0 ms added'}: RTT "
                      f"{hosts.network.rtt_ms(source, destination):.3f} ms, one TCP stream "
                      f"{hosts.network.throughput_mb_s(source, destination):.0f} MB/s", flush=True)
        return
    one_way = None if args.rtt_ms is None else args.rtt_ms / 2
    with test_hosts(args.hosts, one_way) as hosts:
        if args.ray:
            hosts.ray.start()
        for host in hosts.network.hosts:
            print(f"{host.netns}: {host.address}")
        print(f"dashboard {hosts.dashboard_url}  http {hosts.http_url}  grpc {hosts.grpc_target}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()

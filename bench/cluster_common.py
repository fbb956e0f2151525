"""Shared helpers for the cluster benchmarks (bench/cluster_*.py): a 3-node cluster of
separate server processes (keel-server or nats-server) on loopback, each node with its own
config file and store directory, that can be SIGKILLed, SIGSTOPped and restarted on the
same store.
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import nats  # nats-py, from the venv (tests/interop/requirements.txt)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KEEL_SERVER_BIN picks another build (CI runs the short checker on the debug binary).
KEEL = os.environ.get("KEEL_SERVER_BIN") or os.path.join(ROOT, "target", "release", "keel-server")
NATS = shutil.which("nats-server") or "/work/venv/bin/nats-server"

ACCOUNTS = """accounts {
  SYS: { users: [{user: sys, password: pass}] }
  APP: { jetstream: enabled, users: [{user: app, password: pass}] }
}
system_account: SYS
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_ticks(pid):
    """utime + stime of a process, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class Node:
    def __init__(self, cluster, idx):
        self.cluster = cluster
        self.idx = idx
        self.name = f"{cluster.prefix}{idx + 1}"
        self.port = free_port()
        self.cport = free_port()
        self.hport = free_port()
        self.store = os.path.join(cluster.dir, self.name)
        self.conf = os.path.join(cluster.dir, self.name + ".conf")
        self.log = os.path.join(cluster.dir, self.name + ".log")
        self.proc = None
        self.stopped = False  # SIGSTOPped

    @property
    def url(self):
        return f"nats://127.0.0.1:{self.port}"

    def write_conf(self, solo=False):
        routes = ", ".join(f'"nats://127.0.0.1:{n.cport}"' for n in self.cluster.nodes)
        js = f'store_dir: "{self.store}"'
        if self.cluster.js_extra:
            js += "\n  " + self.cluster.js_extra
        text = (
            f"server_name: {self.name}\n"
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.hport}\n"
            f"{ACCOUNTS}"
            f"jetstream {{\n  {js}\n}}\n"
            f"cluster {{\n  name: bench\n  listen: 127.0.0.1:{self.cport}\n"
            f"  routes: [{routes}]\n}}\n"
        )
        with open(self.conf, "w") as f:
            f.write(text)

    def start(self):
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [self.cluster.binary, "-c", self.conf],
            stdout=open(self.log, "a"),
            stderr=subprocess.STDOUT,
        )
        self.stopped = False

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def wait_port(self, timeout=60):
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited: see {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not open its port")

    def kill(self):
        if self.alive():
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.stopped = False

    def term(self, timeout=30):
        if self.alive():
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.stopped = False
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def sigstop(self):
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self):
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def http(self, path, timeout=3):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.hport}{path}", timeout=timeout) as r:
            return json.loads(r.read())


class Cluster:
    """Three nodes of `binary`; `js_extra` goes into each jetstream block."""

    def __init__(self, kind, binary, js_extra="", size=3, base=None):
        self.kind = kind
        self.binary = binary
        self.js_extra = js_extra
        self.prefix = {"keel": "k", "nats": "n"}.get(kind, kind[:1])
        self.dir = tempfile.mkdtemp(prefix=f"cbench-{kind}-", dir=base)
        self.nodes = []
        for i in range(size):
            self.nodes.append(Node(self, i))
        for n in self.nodes:
            n.write_conf()

    def by_name(self, name):
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def start(self):
        for n in self.nodes:
            n.start()
        for n in self.nodes:
            n.wait_port()

    def urls(self, first=0):
        ns = self.nodes[first:] + self.nodes[:first]
        return [n.url for n in ns]

    def stop(self):
        for n in self.nodes:
            n.term()

    def cleanup(self, keep=False):
        self.stop()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def wait_meta(self, timeout=60):
        """Until every live node's /jsz names the same meta leader."""
        t = time.monotonic()
        last = None
        while time.monotonic() - t < timeout:
            try:
                leaders = set()
                for n in self.nodes:
                    if n.alive() and not n.stopped:
                        leaders.add(n.http("/jsz").get("meta_cluster", {}).get("leader"))
                last = leaders
                if len(leaders) == 1 and None not in leaders and "" not in leaders:
                    return leaders.pop()
            except Exception as e:  # noqa: BLE001 - a node still starting
                last = e
            time.sleep(0.2)
        raise RuntimeError(f"{self.kind}: no meta leader: {last}")


async def connect(urls, user="app", **kw):
    opts = dict(
        servers=urls,
        user=user,
        password="pass",
        dont_randomize=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        connect_timeout=2,
        allow_reconnect=True,
    )
    opts.update(kw)

    async def quiet(_e):
        pass

    opts.setdefault("error_cb", quiet)
    opts.setdefault("disconnected_cb", None)
    return await nats.connect(**{k: v for k, v in opts.items() if v is not None})


async def api(nc, subject, body=None, timeout=3.0):
    payload = b"" if body is None else json.dumps(body).encode()
    m = await nc.request(subject, payload, timeout=timeout)
    return json.loads(m.data) if m.data else {}


async def stream_info(nc, stream, timeout=3.0):
    return await api(nc, f"$JS.API.STREAM.INFO.{stream}", None, timeout)


async def wait_stream_leader(nc, stream, timeout=60, not_=None):
    t = time.monotonic()
    last = None
    while time.monotonic() - t < timeout:
        try:
            info = await stream_info(nc, stream, 2)
            last = info
            leader = info.get("cluster", {}).get("leader")
            if leader and leader != not_:
                return info
        except Exception as e:  # noqa: BLE001 - no responders / timeouts while electing
            last = e
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no leader for {stream}: {last}")

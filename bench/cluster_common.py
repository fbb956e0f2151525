"""Shared helpers for the cluster benchmarks (bench/cluster_*.py): a 3-node cluster of
separate server processes (keel-server or nats-server) on loopback, each node with its own
config file and store directory, that can be SIGKILLed, SIGSTOPped and restarted on the
same store; optionally with its routes through a TCP proxy the test controls
(`Partitioner`), which cuts and heals network links between nodes; optionally with each
store directory on its own loop-mounted ext4 image (`LoopDisk`, as root), so that a power
cut can drop what was written but not fsynced; optionally with each node's wall clock under
the test's control (`clocks`: libfaketime, see `clock_unavailable`).
"""

import asyncio
import atexit
import datetime
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import nats  # nats-py, from the venv (tests/interop/requirements.txt)
from procstat import free_port, rss_kib, cpu_ticks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KEEL_SERVER_BIN picks another build (CI runs the short checker on the debug binary).
KEEL = os.environ.get("KEEL_SERVER_BIN") or os.path.join(ROOT, "target", "release", "keel-server")
NATS = shutil.which("nats-server") or "/work/venv/bin/nats-server"

# libfaketime (Debian's libfaketime): preloaded into a node whose wall clock the test moves.
FAKETIME_LIB = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)


def clock_unavailable(binary):
    """Why the wall clock of `binary`'s processes cannot be moved (None if it can). A node
    runs with libfaketime preloaded, reading its offset from a file the test rewrites;
    only CLOCK_REALTIME moves (a clock step, as NTP makes), the monotonic clock does not."""
    if FAKETIME_LIB is None:
        return "libfaketime is not installed (apt-get install libfaketime)"
    with open(binary, "rb") as f:
        head = f.read(4096)
    if b"/ld-linux" not in head:
        # No program interpreter: a static binary (Go's, as nats-server) reads the clock
        # through the vDSO itself, where no LD_PRELOAD reaches.
        return f"{os.path.basename(binary)} is a static binary (LD_PRELOAD cannot reach its clock)"
    return None


ACCOUNTS = """accounts {
  SYS: { users: [{user: sys, password: pass}] }
  APP: { jetstream: enabled, users: [{user: app, password: pass}] }
}
system_account: SYS
"""


def report(lines, out=None):
    """Prints a benchmark's report (its lines), and writes it to `out` when given."""
    text = "\n".join(lines)
    print("\n" + text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")

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
        # With the cluster's `clocks`: the wall clock's offset in seconds, read by
        # libfaketime from this file (at most a second late: FAKETIME_CACHE_DURATION).
        self.clock = os.path.join(cluster.dir, self.name + ".clock")
        self.offset = 0

    @property
    def url(self):
        return f"nats://127.0.0.1:{self.port}"

    def write_conf(self, solo=False):
        px = self.cluster.proxy
        if px is None:
            routes = ", ".join(f'"nats://127.0.0.1:{n.cport}"' for n in self.cluster.nodes)
            advertise = ""
        else:
            routes = ", ".join(f'"nats://127.0.0.1:{p}"' for p in px.route_ports(self.idx))
            advertise = f"  advertise: 127.0.0.1:{px.nowhere_port(self.idx)}\n"
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
            f"  routes: [{routes}]\n{advertise}}}\n"
        )
        with open(self.conf, "w") as f:
            f.write(text)

    def start(self):
        assert self.proc is None or self.proc.poll() is not None
        env = None
        if self.cluster.clocks:
            self._write_clock()
            env = dict(
                os.environ,
                LD_PRELOAD=FAKETIME_LIB,
                FAKETIME_TIMESTAMP_FILE=self.clock,
                FAKETIME_CACHE_DURATION="1",
                FAKETIME_DONT_FAKE_MONOTONIC="1",
                NO_FAKE_STAT="1",
            )
        self.proc = subprocess.Popen(
            [self.cluster.binary, "-c", self.conf],
            stdout=open(self.log, "a"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.stopped = False

    def _write_clock(self):
        tmp = self.clock + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{self.offset:+d}\n")
        os.replace(tmp, self.clock)

    def set_clock(self, offset, timeout=10):
        """Steps this node's wall clock to `offset` seconds from the true time, and waits
        until the node itself says so (its /varz `now`). Returns the offset it reports."""
        assert self.cluster.clocks, "the cluster was made without clocks"
        self.offset = int(offset)
        self._write_clock()
        t = time.monotonic()
        seen = None
        while time.monotonic() - t < timeout:
            seen = self.wall_offset()
            if seen is not None and abs(seen - self.offset) < 5:
                return seen
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: clock offset {seen} after {timeout}s, wanted {self.offset}")

    def wall_offset(self):
        """The node's wall clock minus ours, in seconds, from its /varz `now` (None if it
        does not answer)."""
        try:
            now = self.http("/varz")["now"]
        except Exception:  # noqa: BLE001 - a stopped or starting node
            return None
        return parse_rfc3339(now) - time.time()

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


DISK_SIZE = 2 << 30  # sparse: an image takes only what is written
# ext4 journal commit interval and the page-cache writeback delay during a disk run: the
# longest a write not fsynced may stay in memory only, so what a power cut can lose.
DISK_COMMIT_S = 60  # read when used: the checker's --disk-window sets it
_DIRTY_EXPIRE = "/proc/sys/vm/dirty_expire_centisecs"
_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount", "cp")


def _run(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


def disks_unavailable():
    """Why `LoopDisk` cannot work here (None if it can)."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in _TOOLS if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)}"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    if not os.access(_DIRTY_EXPIRE, os.W_OK):
        return f"{_DIRTY_EXPIRE} not writable"
    return None


_writeback = {"users": 0, "old": None, "set": None}


def delay_writeback():
    """Raises the kernel's dirty page expiry (machine-wide) to DISK_COMMIT_S while a disk
    run lasts, so the flusher does not write back pages dirtied by the run before a power
    cut; refcounted, the old value is put back by the last `restore_writeback()` (and at
    exit)."""
    if _writeback["users"] == 0:
        with open(_DIRTY_EXPIRE) as f:
            old = int(f.read())
        new = max(old, DISK_COMMIT_S * 100)
        with open(_DIRTY_EXPIRE, "w") as f:
            f.write(str(new))
        _writeback.update(old=old, set=new)
    _writeback["users"] += 1


def restore_writeback():
    if _writeback["users"] == 0:
        return
    _writeback["users"] -= 1
    if _writeback["users"] == 0:
        try:
            with open(_DIRTY_EXPIRE) as f:
                now = int(f.read())
            if now == _writeback["set"]:  # not changed by someone else meanwhile
                with open(_DIRTY_EXPIRE, "w") as f:
                    f.write(str(_writeback["old"]))
        except OSError as e:
            print(f"warning: could not restore {_DIRTY_EXPIRE}: {e}", file=sys.stderr)


_mounted = set()  # LoopDisks still mounted, unmounted at exit if cleanup() was skipped


@atexit.register
def _leftovers():
    for d in list(_mounted):
        d.close()
    while _writeback["users"]:
        restore_writeback()


class LoopDisk:
    """An ext4 filesystem in a sparse image file, loop-mounted at `mnt`, whose power can be
    cut: `power_cut()` copies the image file as it is at that moment, which holds only what
    ext4 has written to the loop device (fsynced data, journal commits, and whatever
    writeback happened to write), then drops the mounted filesystem with its dirty pages and
    mounts the copy in its place (ext4 replays its journal), as after a power loss.

    The copy is not atomic: it is taken with the writers dead and writeback delayed
    (`delay_writeback`, journal commit every DISK_COMMIT_S), so normally nothing writes to
    the device meanwhile; `power_cut` returns the sectors written to it during the copy
    (from /sys/block/loopN/stat), which should be 0."""

    def __init__(self, image, mnt, size=DISK_SIZE):
        self.image = image
        self.mnt = mnt
        self.dev = None
        self.cuts = 0
        with open(image, "wb") as f:
            f.truncate(size)
        # Inode tables and journal zeroed now, not by a background thread while mounted.
        _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", image)
        self._mount()
        lf = os.path.join(mnt, "lost+found")
        if os.path.isdir(lf):
            os.rmdir(lf)  # the store directory starts empty, as on a plain directory

    def _mount(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.dev = _run("losetup", "--find", "--show", self.image)
        try:
            _run("mount", "-t", "ext4", "-o", f"commit={DISK_COMMIT_S}", self.dev, self.mnt)
        except Exception:
            subprocess.run(["losetup", "-d", self.dev], capture_output=True)
            self.dev = None
            raise
        _mounted.add(self)

    def written(self):
        """Sectors written to the loop device so far."""
        with open(f"/sys/block/{os.path.basename(self.dev)}/stat") as f:
            return int(f.read().split()[6])

    def snapshot(self):
        """Step 1 of a power cut (for all disks before any is unmounted): copies the image;
        returns sectors written to the device while copying."""
        before = self.written()
        self.cuts += 1
        self._copy = f"{self.image.rsplit('.', 2)[0]}.{self.cuts}.img"
        _run("cp", "--sparse=always", self.image, self._copy)
        return self.written() - before

    def replace(self, keep=False):
        """Step 2: unmounts the filesystem (its flush goes to the old image, discarded) and
        mounts the copy."""
        self._umount()
        if not keep:
            os.unlink(self.image)
        self.image = self._copy
        self._mount()

    def power_cut(self, keep=False):
        w = self.snapshot()
        self.replace(keep)
        return w

    def _umount(self):
        if self.dev is None:
            return
        r = subprocess.run(["umount", self.mnt], capture_output=True, text=True)
        if r.returncode:
            # Something still has it open: detach it lazily rather than leave it.
            print(f"warning: umount {self.mnt}: {r.stderr.strip()}; lazy umount", file=sys.stderr)
            subprocess.run(["umount", "-l", self.mnt], capture_output=True)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)
        self.dev = None
        _mounted.discard(self)

    def close(self):
        try:
            self._umount()
        except Exception as e:  # noqa: BLE001 - cleanup goes on with the others
            print(f"warning: {self.mnt}: {e}", file=sys.stderr)


def disk_selfcheck(base=None):
    """Checks on a small LoopDisk that a power cut drops what was not fsynced: writes
    `before` (no fsync), `synced` (fsync of it and of the directory), `after` (no fsync),
    cuts the power, looks. Returns (ok, one-line report); ok if `synced` is intact and
    `after` is missing or short."""
    d = tempfile.mkdtemp(prefix="diskcheck-", dir=base)
    disk = None
    delay_writeback()
    try:
        disk = LoopDisk(os.path.join(d, "check.0.img"), os.path.join(d, "mnt"), 64 << 20)
        data = {n: os.urandom(256 << 10) for n in ("before", "synced", "after")}
        for name, body in data.items():
            with open(os.path.join(disk.mnt, name), "wb") as f:
                f.write(body)
                if name == "synced":
                    f.flush()
                    os.fsync(f.fileno())
                    fd = os.open(disk.mnt, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
        during = disk.power_cut()
        seen = {}
        for name, body in data.items():
            try:
                with open(os.path.join(disk.mnt, name), "rb") as f:
                    got = f.read()
                seen[name] = "intact" if got == body else f"{len(got)} of {len(body)} bytes"
            except FileNotFoundError:
                seen[name] = "missing"
        ok = seen["synced"] == "intact" and seen["after"] != "intact"
        text = (
            f"disk self-check {'OK' if ok else 'FAILED'}: after a power cut of a loop ext4 "
            f"(commit={DISK_COMMIT_S}), fsynced file {seen['synced']}, unsynced file written "
            f"after it {seen['after']}, unsynced file written before it {seen['before']} "
            f"({during} sectors written during the copy)"
        )
        return ok, text
    finally:
        if disk:
            disk.close()
        restore_writeback()
        shutil.rmtree(d, ignore_errors=True)


class Partitioner:
    """Network partitions between the nodes of a cluster, without root and the same for
    keel-server and nats-server: a TCP proxy the test controls between their cluster ports.
    Node i's routes point at one listener per other node j (the directed pair i->j), which
    forwards to j's cluster port, so every route connection is known to run over the link
    {i, j}. Cutting a link closes its live connections and closes each new one as soon as
    it is accepted (mode "close"), or freezes them, forwarding nothing until the link is
    healed and new ones connected only then (mode "hang", a network that drops packets).

    Servers tell each other their route URLs by gossip and dial what they learn: each node
    advertises (`cluster.advertise`) a port of its own that is bound but not listening, so
    such a dial is refused and every route goes through the proxy (`Cluster.direct_routes`
    checks). The proxy runs on its own thread and event loop, so a busy publisher loop
    does not delay route traffic, nor the proxy the publishers.
    """

    READ = 1 << 18

    def __init__(self, size, mode="close"):
        assert mode in ("close", "hang")
        self.mode = mode
        self.size = size
        self.targets = {}  # node index -> its cluster port (set by Cluster)
        self._listen = {}
        self._nowhere = []
        for i in range(size):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))  # reserved, never listening: connections are refused
            self._nowhere.append(s)
            for j in range(size):
                if i != j:
                    s = socket.socket()
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", 0))
                    s.listen(64)
                    s.setblocking(False)
                    self._listen[(i, j)] = s
        self.stats = {"connections": 0, "refused": 0, "held": 0, "cut": 0, "bytes": 0}
        self._cut = set()  # frozenset({i, j})
        self._live = {}  # link -> set of (transport, transport)
        self._healed = {}  # link -> asyncio.Event, set while the link is up (mode hang)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proxy", daemon=True)
        self._thread.start()
        self._servers = [self._call(self._serve(i, j, s)) for (i, j), s in self._listen.items()]

    def route_ports(self, i):
        return [s.getsockname()[1] for (a, _), s in sorted(self._listen.items()) if a == i]

    def nowhere_port(self, i):
        return self._nowhere[i].getsockname()[1]

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self, i, j, sock):
        return await asyncio.start_server(
            lambda r, w: self._conn(frozenset((i, j)), j, r, w), sock=sock
        )

    def _event(self, link):
        if link not in self._healed:
            self._healed[link] = asyncio.Event()
            self._healed[link].set()
        return self._healed[link]

    async def _conn(self, link, j, r, w):
        if link in self._cut and self.mode == "close":
            self.stats["refused"] += 1
            w.transport.abort()
            return
        healed = self._event(link)
        if not healed.is_set():
            self.stats["held"] += 1
            await healed.wait()
        try:
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.targets[j])
        except OSError:  # the node is down
            w.transport.abort()
            return
        pair = (w.transport, w2.transport)
        if link in self._cut and self.mode == "close":  # cut while connecting
            for t in pair:
                t.abort()
            return
        self.stats["connections"] += 1
        live = self._live.setdefault(link, set())
        live.add(pair)
        try:
            await asyncio.gather(self._pump(link, r, w2, pair), self._pump(link, r2, w, pair))
        finally:
            live.discard(pair)

    async def _pump(self, link, r, w, pair):
        healed = self._event(link)
        try:
            while True:
                data = await r.read(self.READ)
                if not data:
                    break
                await healed.wait()  # mode hang: held until the link is healed
                self.stats["bytes"] += len(data)
                w.write(data)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # Route connections do not half-close: one side gone ends both.
            for t in pair:
                t.abort()

    async def _set(self, links, cut):
        n = 0
        for link in links:
            if cut:
                self._cut.add(link)
                if self.mode == "hang":
                    self._event(link).clear()
                    n += len(self._live.get(link, ()))
                    continue
                for pair in list(self._live.get(link, ())):
                    n += 1
                    for t in pair:
                        t.abort()
            else:
                self._cut.discard(link)
                self._event(link).set()
        self.stats["cut"] += n if cut else 0
        return n

    def cut(self, pairs):
        """Cuts the links between the node index pairs given; returns how many live route
        connections were closed (mode close) or frozen (mode hang)."""
        return self._call(self._set([frozenset(p) for p in pairs], True))

    def heal(self):
        self._call(self._set(list(self._cut), False))

    def isolate(self, i):
        """Cuts node i off from all the others."""
        return self.cut([(i, j) for j in range(self.size) if j != i])

    def stop(self):
        async def close():
            for srv in self._servers:
                srv.close()
            for ev in self._healed.values():
                ev.set()
            for live in self._live.values():
                for pair in list(live):
                    for t in pair:
                        t.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            self._call(close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        for s in [*self._nowhere, *self._listen.values()]:
            s.close()


def _socket_inodes(pid):
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _established_tcp():
    """inode -> (local port, remote port) of every established TCP socket."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    c = line.split()
                    if c[3] == "01":
                        out[c[9]] = (int(c[1].rsplit(":", 1)[1], 16), int(c[2].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return out


class Cluster:
    """Three nodes of `binary`; `js_extra` goes into each jetstream block. With
    `partitions` ("close" or "hang", see `Partitioner`) the routes go through a proxy
    (`self.proxy`) that can cut links between nodes. With `disks` (root only, see
    `disks_unavailable`) each node's store directory is its own `LoopDisk`, and
    `power_cut()` cuts the power of all of them. With `clocks` (see `clock_unavailable`)
    each node's wall clock can be stepped (`Node.set_clock`)."""

    def __init__(
        self, kind, binary, js_extra="", size=3, base=None, partitions=None, disks=False, clocks=False
    ):
        self.kind = kind
        self.binary = binary
        self.clocks = clocks
        self.js_extra = js_extra
        self.prefix = {"keel": "k", "nats": "n"}.get(kind, kind[:1])
        self.dir = tempfile.mkdtemp(prefix=f"cbench-{kind}-", dir=base)
        self.proxy = Partitioner(size, partitions) if partitions else None
        self.nodes = []
        for i in range(size):
            self.nodes.append(Node(self, i))
        if self.proxy:
            self.proxy.targets = {n.idx: n.cport for n in self.nodes}
        for n in self.nodes:
            n.write_conf()
        self.disks = []
        self._delayed = False
        if disks:
            delay_writeback()
            self._delayed = True
            try:
                for n in self.nodes:
                    img = os.path.join(self.dir, f"{n.name}.0.img")
                    self.disks.append(LoopDisk(img, n.store))
            except BaseException:
                self._close_disks()
                if self.proxy:
                    self.proxy.stop()
                shutil.rmtree(self.dir, ignore_errors=True)
                raise

    def kill_all(self):
        """SIGKILL every live node at (as close as signals allow to) the same moment."""
        live = [n for n in self.nodes if n.alive()]
        for n in live:
            os.kill(n.proc.pid, signal.SIGKILL)
        for n in live:
            n.proc.wait()
            n.stopped = False

    def power_cut(self, keep=False):
        """With `disks`, the nodes already killed: copies every image before unmounting
        any, then mounts the copies (see LoopDisk). Returns the sectors written to the
        devices during the copies (0 unless writeback ran meanwhile)."""
        assert self.disks and not any(n.alive() for n in self.nodes)
        during = sum(d.snapshot() for d in self.disks)
        for d in self.disks:
            d.replace(keep)
        return during

    def _close_disks(self):
        for d in self.disks:
            d.close()
        self.disks = []
        if self._delayed:
            restore_writeback()
            self._delayed = False

    def direct_routes(self):
        """Established connections from a node to another node's cluster port (with the
        proxy, which alone should make those, this lists routes that bypass it)."""
        tcp = _established_tcp()
        cports = {n.cport: n.name for n in self.nodes}
        out = []
        for n in self.nodes:
            if not n.alive():
                continue
            for ino in _socket_inodes(n.proc.pid):
                ports = tcp.get(ino)
                if ports and ports[1] in cports and cports[ports[1]] != n.name:
                    out.append(f"{n.name}->{cports[ports[1]]}")
        return out

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
        """Stops the nodes, the proxy, unmounts the disks (keep: leaves the images, the
        stores as they were at the end, and the logs), removes the directory."""
        try:
            self.stop()
        finally:
            if self.proxy:
                self.proxy.stop()
            if self.disks or self._delayed:
                self.kill_all()  # a node that did not stop on SIGTERM holds its mount
                self._close_disks()
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


def parse_rfc3339(text):
    """Seconds since the epoch of an RFC 3339 time in UTC with up to nine fractional digits
    (the monitoring endpoints' `now`)."""
    main, _, frac = text.rstrip("Z").partition(".")
    t = datetime.datetime.strptime(main, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


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


async def create_stream(nc, config):
    """STREAM.CREATE (an error raises); once the stream has a leader, its STREAM.INFO."""
    r = await api(nc, f"$JS.API.STREAM.CREATE.{config['name']}", config, timeout=15)
    if "error" in r:
        raise RuntimeError(f"stream create: {r}")
    return await wait_stream_leader(nc, config["name"])


def replicas_current(info, replicas=2, lag_ok=True):
    """Whether a STREAM.INFO shows a leader and its `replicas` others current (with
    `lag_ok` False, also with no lag)."""
    reps = info.get("cluster", {}).get("replicas") or []
    return bool(
        info.get("cluster", {}).get("leader")
        and len(reps) == replicas
        and all(r.get("current") and (lag_ok or not r.get("lag")) for r in reps)
    )


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

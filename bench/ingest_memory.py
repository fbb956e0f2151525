#!/usr/bin/env python3
"""Server memory under a flood of plain publishes into a file stream (issue 9, item 1).

For each server binary given (keel-server, then the reference nats-server: one after the
other, same load), and for each variant:

  plain      two connections send `PUB load.x <size>` (no reply subject) as fast as the
             server reads them, for --duration seconds, into a file stream LOAD
             (subjects load.>, max_bytes --max-bytes); then --idle seconds of quiet.
  consumers  the same, with a push consumer whose subscriber never reads its socket and a
             pull consumer whose client fetches (one huge request) and never acks.

VmRSS is read from /proc/<pid>/status every 100 ms. Printed per run: peak RSS during the
ingest, RSS when the publishers stop, RSS --idle seconds later (and when it first went under
64 MiB), messages the publishers sent and the stream's last sequence (stored) per second.

Only the Python standard library and nats-py (for the setup requests) are used. The flood
itself is raw protocol on plain sockets, written in large prebuilt chunks, so Python's
per-message overhead does not limit it.
"""

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from procstat import free_port  # noqa: E402
from procstat import rss_kib as _rss_kib  # noqa: E402


def rss_kib(pid):
    """As procstat's, with a gone process counted as 0 KiB (this script's maxima)."""
    return _rss_kib(pid) or 0


MIB = 1024 * 1024


class Conn:
    """A raw NATS connection: answers server PINGs from a reader thread, optionally
    discarding whatever else arrives (`drain`), or never reading at all (`drain=False`,
    used for the stuck push subscriber: after the handshake nothing is read)."""

    def __init__(self, port, name, drain=True):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lock = threading.Lock()
        self.closed = False
        f = self.sock.makefile("rb")
        f.readline()  # INFO
        connect = {"verbose": False, "pedantic": False, "headers": True, "name": name,
                   "lang": "python-raw", "version": "0", "protocol": 1}
        self.sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        while True:
            line = f.readline()
            if not line or line.startswith(b"PONG"):
                break
        self.file = f
        if drain:
            threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self):
        # Scans for PING at line starts; payload bytes are skipped by MSG/HMSG sizes.
        f = self.file
        try:
            while not self.closed:
                line = f.readline()
                if not line:
                    return
                if line.startswith(b"PING"):
                    self.send(b"PONG\r\n")
                elif line.startswith(b"MSG") or line.startswith(b"HMSG"):
                    n = int(line.split()[-1])
                    f.read(n + 2)
        except (OSError, ValueError):
            return

    def send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def close(self):
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def flood(port, size, stop, counter, idx):
    """Sends PUB load.x <size> in 256-message chunks until `stop` is set."""
    c = Conn(port, f"flood-{idx}")
    payload = b"x" * size
    one = b"PUB load.x %d\r\n" % size + payload + b"\r\n"
    per_chunk = max(1, (256 * 1024) // len(one))
    chunk = one * per_chunk
    sent = 0
    try:
        while not stop.is_set():
            c.send(chunk)
            sent += per_chunk
    except OSError:
        pass
    counter[idx] = sent
    c.close()


async def setup(port, max_bytes, consumers):
    import nats  # nats-py, from /work/venv or tests/interop/requirements.txt

    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    js = nc.jetstream(timeout=10)
    from nats.js.api import StreamConfig, StorageType, ConsumerConfig, AckPolicy

    await js.add_stream(StreamConfig(name="LOAD", subjects=["load.>"],
                                     storage=StorageType.FILE, max_bytes=max_bytes))
    if consumers:
        await js.add_consumer("LOAD", ConsumerConfig(durable_name="PUSH",
                                                     deliver_subject="push.stuck",
                                                     ack_policy=AckPolicy.EXPLICIT))
        await js.add_consumer("LOAD", ConsumerConfig(durable_name="PULL",
                                                     ack_policy=AckPolicy.EXPLICIT))
    await nc.close()


async def stream_last_seq(port):
    import nats

    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    js = nc.jetstream(timeout=30)
    si = await js.stream_info("LOAD")
    await nc.close()
    return si.state.last_seq, si.state.bytes


def run_one(name, binary, variant, args):
    port = free_port()
    store = tempfile.mkdtemp(prefix=f"ingest-{name}-")
    log = open(os.path.join(store, "server.log"), "w")
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js",
                             "-sd", os.path.join(store, "js")],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        asyncio.run(setup(port, args.max_bytes, variant == "consumers"))
        extra = []
        if variant == "consumers":
            # The push subscriber: subscribes, then never reads its socket again.
            push = Conn(port, "push-stuck", drain=False)
            push.send(b"SUB push.stuck 1\r\n")
            # The pull client: one request for a million messages, read, never acked.
            pull = Conn(port, "pull-noack")
            pull.send(b"SUB pull.inbox 1\r\nPUB $JS.API.CONSUMER.MSG.NEXT.LOAD.PULL pull.inbox "
                      + str(len(b'{"batch":1000000}')).encode() + b"\r\n{\"batch\":1000000}\r\n")
            extra = [push, pull]
        base = rss_kib(proc.pid)
        stop = threading.Event()
        counter = [0] * args.conns
        threads = [threading.Thread(target=flood, args=(port, args.size, stop, counter, i))
                   for i in range(args.conns)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        peak = 0
        trace = []
        while time.monotonic() - t0 < args.duration:
            r = rss_kib(proc.pid)
            peak = max(peak, r)
            trace.append((round(time.monotonic() - t0, 1), r))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
        t_stop = time.monotonic()
        at_stop = rss_kib(proc.pid)
        under64 = None
        after = at_stop
        while time.monotonic() - t_stop < args.idle:
            r = rss_kib(proc.pid)
            after = r
            if under64 is None and r < 64 * 1024:
                under64 = time.monotonic() - t_stop
            # The queue may still be draining into the store: that is ingest too.
            peak = max(peak, r)
            trace.append((round(time.monotonic() - t0, 1), r))
            time.sleep(0.1)
        after = rss_kib(proc.pid)
        last_seq, stored_bytes = asyncio.run(stream_last_seq(port))
        for c in extra:
            c.close()
        sent = sum(counter)
        return {
            "server": name, "variant": variant, "base_kib": base, "peak_kib": peak,
            "at_stop_kib": at_stop, "after_idle_kib": after,
            "under_64mib_s": None if under64 is None else round(under64, 1),
            "sent": sent, "stored": last_seq, "stored_bytes": stored_bytes,
            "sent_per_s": round(sent / args.duration),
            "stored_per_s": round(last_seq / args.duration),
            "alive": proc.poll() is None,
            "trace": trace[:: max(1, len(trace) // 60)],
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(store, ignore_errors=True)


def mib(kib):
    return f"{kib / 1024:,.0f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", action="append", required=True,
                   help="NAME=BINARY, repeatable; run in the order given")
    p.add_argument("--variant", action="append", choices=["plain", "consumers"])
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--idle", type=float, default=10)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--conns", type=int, default=2)
    p.add_argument("--max-bytes", type=int, default=256 * 1000 * 1000)
    p.add_argument("--json", help="also write the raw results (with RSS traces) here")
    args = p.parse_args()
    variants = args.variant or ["plain", "consumers"]
    results = []
    for variant in variants:
        for spec in args.server:
            name, _, binary = spec.partition("=")
            print(f"running {name} / {variant} ...", file=sys.stderr, flush=True)
            r = run_one(name, binary, variant, args)
            results.append(r)
            print(f"  peak {mib(r['peak_kib'])} MiB, after idle {mib(r['after_idle_kib'])} MiB,"
                  f" stored {r['stored_per_s']:,}/s", file=sys.stderr, flush=True)
    print(f"{args.conns} connections, PUB {args.size} B, no reply, {args.duration:.0f} s ingest "
          f"into a file stream (max_bytes {args.max_bytes:,}), then {args.idle:.0f} s idle")
    hdr = (f"{'variant':<10} {'server':<6} {'peak RSS MiB':>12} {'at stop MiB':>11} "
           f"{'+%ds MiB' % args.idle:>9} {'<64MiB after':>12} {'sent msgs/s':>11} "
           f"{'stored msgs/s':>13} {'stored MB/s':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        u = "never" if r["under_64mib_s"] is None else f"{r['under_64mib_s']} s"
        print(f"{r['variant']:<10} {r['server']:<6} {mib(r['peak_kib']):>12} "
              f"{mib(r['at_stop_kib']):>11} {mib(r['after_idle_kib']):>9} {u:>12} "
              f"{r['sent_per_s']:>11,} {r['stored_per_s']:>13,} "
              f"{r['stored_per_s'] * args.size / 1e6:>11.1f}"
              + ("" if r["alive"] else "  (server died)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

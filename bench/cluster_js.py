#!/usr/bin/env python3
"""Clustered JetStream publish: a 3-node cluster (separate processes), one R3 file stream,
keel-server vs nats-server (default lazy fsync) vs nats-server with
`jetstream { sync_interval: always }` (fsync before each ack, as keel always does), in one run.

For each server in turn, on a fresh cluster: the stream `benchstream` (subject js.bench,
R3, file) is created through the API, its leader found (STREAM.INFO cluster.leader), and
`keel bench js` (the CLI on async-nats, target/release/keel) is run against the leader:

  async   --msgs messages of --size bytes, --window PubAcks in flight (throughput)
  sync    --sync-msgs messages from one publisher waiting for each ack (p50/p99 latency),
          on the purged stream (with --full-sync: on the async phase's messages)
  consume the async phase's messages read by one durable pull consumer (R3, with its
          stream) with --window per pull and explicit acks (throughput), then
          --sync-msgs more by a second durable whose every ack waits for the server's
          confirmation (AckSync; on keel a confirmed ack is on a quorum's disks)

The async phase's CPU time per message is reported too: the three servers' together, and the
client's (the same client for every server), which is what bounds the throughput where
both share the machine's cores.

Also each node's RSS after the consume phases (the async phase's messages still stored).
Prints one table with keel/reference ratios (against both reference variants).

Usage: bench/cluster_js.py [--msgs 100000] [--size 128] [--window 500] [--sync-msgs 5000]
                          [--storage file|memory] [--full-sync]
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import (  # noqa: E402
    cpu_ticks,
    KEEL,
    NATS,
    ROOT,
    api,
    Cluster,
    connect,
    create_stream,
    rss_kib,
    report,
)

CLI = os.path.join(ROOT, "target", "release", "keel")
STREAM = "benchstream"
STORAGE = "file"  # --storage
REPLICAS = 3  # --replicas


async def create(cl):
    nc = await connect(cl.urls())
    info = await create_stream(
        nc, {"name": STREAM, "subjects": ["js.bench"], "storage": STORAGE, "num_replicas": REPLICAS}
    )
    await nc.close()
    return info["cluster"]["leader"]


async def purge(cl):
    nc = await connect(cl.urls())
    await api(nc, f"$JS.API.STREAM.PURGE.{STREAM}", None, timeout=30)
    await nc.close()


def keel_cli(url, args):
    """`keel --json ...` as the bench user against `url`; its JSON output."""
    cmd = [CLI, "--server", url, "--user", "app", "--password", "pass", "--json"] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr or p.stdout}")
    return json.loads(p.stdout)


def bench(url, mode, msgs, size, window=None):
    args = ["bench", "js", "pub", mode, "js.bench", "--stream", STREAM, "--msgs", str(msgs)]
    args += ["--size", str(size), "--no-progress"]
    if window:
        args += ["--batch", str(window)]
    return keel_cli(url, args)


def consume(url, msgs, batch, consumer, doubleack=False):
    args = ["bench", "js", "consume", "--stream", STREAM, "--consumer", consumer]
    args += ["--msgs", str(msgs), "--batch", str(batch), "--acks", "explicit", "--no-progress"]
    if doubleack:
        args.append("--doubleack")
    return keel_cli(url, args)


def run_one(label, binary, js_extra, args):
    print(f"== {label}", flush=True)
    kind = "keel" if binary == KEEL else "nats"
    cl = Cluster(kind, binary, js_extra=js_extra, base=args.dir)
    try:
        cl.start()
        cl.wait_meta()
        leader = asyncio.run(create(cl))
        url = cl.by_name(leader).url
        # CPU time of the async phase, per message: the three servers' (from /proc) and
        # the client's (the CLI is a child: its times count once it has been waited for).
        hz = os.sysconf("SC_CLK_TCK")
        servers0 = sum(cpu_ticks(n.proc.pid) for n in cl.nodes)
        client0 = os.times()
        a = bench(url, "async", args.msgs, args.size, args.window)
        client1 = os.times()
        servers_us = (sum(cpu_ticks(n.proc.pid) for n in cl.nodes) - servers0) / hz * 1e6 / args.msgs
        client_us = (
            (client1.children_user + client1.children_system)
            - (client0.children_user + client0.children_system)
        ) * 1e6 / args.msgs
        print(
            f"   async: {a['msgs_per_s']:.0f} msgs/s; CPU per message: servers {servers_us:.2f} us, client {client_us:.2f} us",
            flush=True,
        )
        c = consume(url, args.msgs, args.window, "bench-c")
        print(f"   consume+ack: {c['msgs_per_s']:.0f} msgs/s", flush=True)
        d = consume(url, args.sync_msgs, args.window, "bench-d", doubleack=True)
        print(f"   consume+AckSync: {d['msgs_per_s']:.0f} msgs/s", flush=True)
        # Holding the async phase's messages and two durables (a memory stream: in memory,
        # with what its group's log still keeps).
        rss = [rss_kib(n.proc.pid) / 1024 for n in cl.nodes]
        print(f"   RSS per node: {', '.join(f'{r:.1f}' for r in rss)} MiB", flush=True)
        if not args.full_sync:
            asyncio.run(purge(cl))
        s = bench(url, "sync", args.sync_msgs, args.size)
        lat = s.get("latency_us", {})
        print(
            f"   sync: {s['msgs_per_s']:.0f} msgs/s p50 {lat.get('p50')} us p99 {lat.get('p99')} us",
            flush=True,
        )
        return {
            "async": a["msgs_per_s"],
            "servers_us": servers_us,
            "client_us": client_us,
            "consume": c["msgs_per_s"],
            "acksync": d["msgs_per_s"],
            "sync": s["msgs_per_s"],
            "p50": lat.get("p50"),
            "p99": lat.get("p99"),
            "p999": lat.get("p99_9"),
            "max": lat.get("max"),
            "rss": max(rss),
            "rss_total": sum(rss),
        }
    finally:
        cl.cleanup(keep=args.keep)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--msgs", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--sync-msgs", type=int, default=5000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--storage",
        choices=["file", "memory"],
        default="file",
        help="the stream's storage (memory: a PubAck means a quorum holds it in memory, on both servers)",
    )
    ap.add_argument("--replicas", type=int, default=3, help="the stream's num_replicas (1, 3 or 5)")
    ap.add_argument(
        "--full-sync",
        action="store_true",
        help="run the sync phase on the stream as the async phase left it (its --msgs messages"
        " kept) instead of purged: what a large stream's snapshots cost a publisher waiting",
    )
    args = ap.parse_args()
    global STORAGE, REPLICAS
    STORAGE = args.storage
    REPLICAS = args.replicas
    started = time.time()
    runs = [
        ("keel", KEEL, ""),
        ("nats", NATS, ""),
        ("nats-always", NATS, "sync_interval: always"),
    ]
    res = {label: run_one(label, b, extra, args) for label, b, extra in runs}
    k, n, na = res["keel"], res["nats"], res["nats-always"]
    lines = [
        f"cluster_js.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s; {os.cpu_count()} cores shared by the 3 servers and the client)",
        f"3 separate processes, R{args.replicas} {args.storage} stream, client (keel bench js, async-nats) on the leader;"
        f" async: {args.msgs} x {args.size} B, {args.window} in flight; sync: {args.sync_msgs} msgs;"
        f" consume: {args.msgs} msgs, {args.window} per pull; AckSync consume: {args.sync_msgs} msgs"
        + ("; sync phase on the full stream" if args.full_sync else ""),
        "nats = nats-server default (lazy fsync); nats-always = jetstream { sync_interval: always }",
        "",
        f"{'':26} {'keel':>10} {'nats':>10} {'nats-always':>12} {'keel/nats':>10} {'keel/always':>12}",
    ]

    def row(label, key, fmt):
        a, b, c = k[key], n[key], na[key]
        r1 = f"{a / b:.2f}" if a is not None and b else "-"
        r2 = f"{a / c:.2f}" if a is not None and c else "-"
        f = lambda v: fmt.format(v) if v is not None else "-"  # noqa: E731
        lines.append(f"{label:26} {f(a):>10} {f(b):>10} {f(c):>12} {r1:>10} {r2:>12}")

    row("async msgs/s", "async", "{:.0f}")
    row("async CPU us/msg: servers", "servers_us", "{:.2f}")
    row("async CPU us/msg: client", "client_us", "{:.2f}")
    row("sync msgs/s", "sync", "{:.0f}")
    row("sync p50 (us)", "p50", "{:.0f}")
    row("sync p99 (us)", "p99", "{:.0f}")
    row("sync p99.9 (us)", "p999", "{:.0f}")
    row("sync max (us)", "max", "{:.0f}")
    row("consume+ack msgs/s", "consume", "{:.0f}")
    row("consume+AckSync msgs/s", "acksync", "{:.0f}")
    row("max node RSS MiB", "rss", "{:.1f}")
    row("total RSS MiB", "rss_total", "{:.1f}")
    report(lines, args.out)


if __name__ == "__main__":
    main()

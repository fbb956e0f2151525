#!/usr/bin/env python3
"""The cost of an idle clustered JetStream at scale: keel-server and nats-server side by
side in one run.

For each server in turn: a 3-node cluster of separate processes, one R3 file stream with
--msgs small messages, --consumers durable pull consumers on it (explicit ack,
num_replicas 3; on the reference each one is its own Raft group, on keel they are carried
in the stream's group), then --settle seconds to let creation traffic end, then an idle
window of --idle seconds with no client traffic at all (clients disconnected). Per node:
CPU % over the window from /proc/<pid>/stat (utime + stime, 100 % = one core) and VmRSS at
its end. Prints one table with keel/nats ratios (the issue's goal: <= 0.5x on both).

Usage: bench/cluster_idle.py [--consumers 1000] [--idle 30] [--out FILE]
"""

import argparse
import asyncio
import os
import sys
import time

import nats  # nats-py, from the venv
import nats.js.errors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import (  # noqa: E402
    KEEL,
    NATS,
    api,
    Cluster,
    connect,
    cpu_ticks,
    create_stream,
    rss_kib,
    stream_info,
    report,
)

STREAM = "IDLE"
HZ = os.sysconf("SC_CLK_TCK")


async def setup(cl, args):
    nc = await connect(cl.urls())
    await create_stream(
        nc, {"name": STREAM, "subjects": ["idle.>"], "storage": "file", "num_replicas": 3}
    )
    js = nc.jetstream(timeout=10)
    # The stream's interest may not have reached this connection's server yet (seen with
    # nats-server right after the create): the first publish waits for it.
    deadline = time.monotonic() + 10
    while True:
        try:
            await js.publish("idle.0", b"x" * 64)
            break
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    for i in range(1, args.msgs):
        await js.publish(f"idle.{i % 10}", b"x" * 64)
    sem = asyncio.Semaphore(args.parallel)
    failures = []

    async def create(i):
        name = f"C{i:05d}"
        body = {
            "stream_name": STREAM,
            "config": {
                "durable_name": name,
                "ack_policy": "explicit",
                "deliver_policy": "all",
                # No num_replicas: it inherits the stream's R3 on both servers (keel
                # refuses an explicit 3, see the report).
            },
        }
        async with sem:
            for attempt in range(10):
                try:
                    r = await api(
                        nc, f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.{name}", body, timeout=10
                    )
                    if "error" not in r:
                        return
                    err = r["error"]
                except Exception as e:  # noqa: BLE001 - timeouts under load: retry
                    err = repr(e)
                await asyncio.sleep(0.5 * (attempt + 1))
            failures.append((name, err))

    t = time.monotonic()
    await asyncio.gather(*(create(i) for i in range(args.consumers)))
    took = time.monotonic() - t
    # Until the stream reports every consumer.
    count = None
    for _ in range(120):
        try:
            count = (await stream_info(nc, STREAM, 5))["state"].get("consumer_count")
            if count == args.consumers:
                break
        except Exception:  # noqa: BLE001
            pass
        await asyncio.sleep(0.5)
    await nc.close()
    return took, count, failures


def measure(cl, idle):
    pids = {n.name: n.proc.pid for n in cl.nodes}
    t0 = time.monotonic()
    c0 = {k: cpu_ticks(p) for k, p in pids.items()}
    time.sleep(idle)
    c1 = {k: cpu_ticks(p) for k, p in pids.items()}
    dt = time.monotonic() - t0
    out = {}
    for k, p in pids.items():
        out[k] = {
            "cpu": 100.0 * (c1[k] - c0[k]) / HZ / dt,
            "rss": rss_kib(p),
        }
    return out


def run_one(kind, binary, args):
    print(f"== {kind}: {binary}", flush=True)
    cl = Cluster(kind, binary, base=args.dir)
    try:
        cl.start()
        cl.wait_meta()
        took, count, failures = asyncio.run(setup(cl, args))
        print(
            f"   {args.consumers} consumers created in {took:.1f} s; stream reports "
            f"{count}; failures {len(failures)} {failures[:3]}",
            flush=True,
        )
        rss_before = {n.name: rss_kib(n.proc.pid) for n in cl.nodes}
        time.sleep(args.settle)
        m = measure(cl, args.idle)
        for n in cl.nodes:
            print(
                f"   {n.name}: cpu {m[n.name]['cpu']:.2f} %  rss {m[n.name]['rss'] / 1024:.1f} MiB"
                f" (after create {rss_before[n.name] / 1024:.1f} MiB)",
                flush=True,
            )
        return {"create_s": took, "count": count, "failures": len(failures), "nodes": m}
    finally:
        cl.cleanup(keep=args.keep)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--consumers", type=int, default=1000)
    ap.add_argument("--msgs", type=int, default=100)
    ap.add_argument("--idle", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--parallel", type=int, default=16, help="consumer creates in flight")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["keel", "nats"], help="one server (no table)")
    args = ap.parse_args()
    started = time.time()
    res = {
        k: run_one(k, b, args)
        for k, b in (("keel", KEEL), ("nats", NATS))
        if not args.only or args.only == k
    }
    if args.only:
        return
    lines = [
        f"cluster_idle.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s; {os.cpu_count()} cores; the two clusters run one after "
        "the other)",
        f"3 separate processes per server, one R3 file stream ({args.msgs} msgs), "
        f"{args.consumers} durable pull consumers (R3: the stream's replicas, inherited), settle {args.settle:.0f} s, "
        f"idle window {args.idle:.0f} s; CPU 100 % = one core",
        "",
        f"{'':26} {'keel':>10} {'nats-server':>12} {'keel/ref':>9}",
    ]

    def row(label, a, b, fmt):
        ratio = f"{a / b:.3f}" if b else "-"
        lines.append(f"{label:26} {fmt.format(a):>10} {fmt.format(b):>12} {ratio:>9}")

    row("consumer create (s)", res["keel"]["create_s"], res["nats"]["create_s"], "{:.1f}")
    kn, nn = res["keel"]["nodes"], res["nats"]["nodes"]
    for i, (a, b) in enumerate(zip(sorted(kn), sorted(nn))):
        row(f"node {i + 1} idle CPU %", kn[a]["cpu"], nn[b]["cpu"], "{:.2f}")
    for i, (a, b) in enumerate(zip(sorted(kn), sorted(nn))):
        row(f"node {i + 1} RSS MiB", kn[a]["rss"] / 1024, nn[b]["rss"] / 1024, "{:.1f}")
    row(
        "total idle CPU %",
        sum(v["cpu"] for v in kn.values()),
        sum(v["cpu"] for v in nn.values()),
        "{:.2f}",
    )
    row(
        "total RSS MiB",
        sum(v["rss"] for v in kn.values()) / 1024,
        sum(v["rss"] for v in nn.values()) / 1024,
        "{:.1f}",
    )
    lines.append(
        f"consumers reported: keel {res['keel']['count']}, nats {res['nats']['count']}; "
        f"create failures: keel {res['keel']['failures']}, nats {res['nats']['failures']}"
    )
    lines.append("goal (issue): keel/ref <= 0.5 on idle CPU and RSS")
    report(lines, args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Stream churn on a 3-node keel cluster (separate processes): an R3 file stream created,
20 messages published to it, a durable consumer added, the stream deleted, --streams times.
Reports each node's RSS every 50 rounds, and at the end its threads, open file descriptors
and the size of its meta group's log on disk (`jetstream/_cluster_/meta`, which is kept
whole: it grows by each create and delete).

What it checks: a deleted stream's Raft group, store, log and tasks are let go (memory,
threads and descriptors stay flat once the allocator has warmed up).

Usage: bench/stream_churn.py [--streams 1200] [--dir D] [--out F]
"""

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import KEEL, Cluster, api, connect, create_stream, report, rss_kib  # noqa: E402


def dir_bytes(d):
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                n += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return n


async def churn(cl, rounds, lines):
    nc = await connect(cl.urls())
    for i in range(rounds):
        name = f"churn{i}"
        await create_stream(
            nc, {"name": name, "subjects": [f"churn.{i}"], "storage": "file", "num_replicas": 3}
        )
        for _ in range(20):
            await nc.request(f"churn.{i}", b"x" * 100, timeout=5)
        await api(
            nc,
            f"$JS.API.CONSUMER.DURABLE.CREATE.{name}.d",
            {"stream_name": name, "config": {"durable_name": "d", "ack_policy": "explicit"}},
            timeout=10,
        )
        await api(nc, f"$JS.API.STREAM.DELETE.{name}", None, timeout=10)
        if i % 50 == 0 or i == rounds - 1:
            rss = ", ".join(f"{rss_kib(n.proc.pid) / 1024:.1f}" for n in cl.nodes)
            line = f"after {i + 1:5d} streams: RSS per node {rss} MiB"
            print(line, flush=True)
            lines.append(line)
    await nc.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1200)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    started = time.time()
    lines = []
    cl = Cluster("keel", KEEL, js_extra="", base=args.dir)
    try:
        cl.start()
        cl.wait_meta()
        asyncio.run(churn(cl, args.streams, lines))
        time.sleep(3)
        for n in cl.nodes:
            pid = n.proc.pid
            meta = os.path.join(n.store, "jetstream", "_cluster_", "meta")
            lines.append(
                f"{n.name}: RSS {rss_kib(pid) / 1024:.1f} MiB, threads {len(os.listdir(f'/proc/{pid}/task'))},"
                f" open fds {len(os.listdir(f'/proc/{pid}/fd'))}, meta log {dir_bytes(meta) / 1024:.0f} KiB"
            )
    finally:
        cl.cleanup(keep=False)
    head = (
        f"stream_churn.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))},"
        f" {time.time() - started:.0f} s): 3-node keel cluster, {args.streams} R3 file streams"
        " each created, given 20 messages and a durable, and deleted"
    )
    report([head, ""] + lines, args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Stream create and update latency on 3-node clusters, keel and nats-server side by side in
one run: --streams file streams created one after another through STREAM.CREATE (R1, then
R3), each timed from the request to its answer (a replicated stream is answered once it has
a leader, on both servers); then each updated once (STREAM.UPDATE, a new max_msgs), timed the
same way. Reports the median and p90 per kind and the ratio keel / nats-server.

Usage: bench/stream_create.py [--streams 60] [--out F]
"""

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import KEEL, NATS, Cluster, api, connect, report  # noqa: E402


async def creates(cl, n, replicas):
    nc = await connect(cl.urls())
    took = []
    for i in range(n):
        name = f"r{replicas}s{i}"
        config = {"name": name, "subjects": [f"{name}.>"], "num_replicas": replicas, "storage": "file"}
        t = time.perf_counter()
        r = await api(nc, f"$JS.API.STREAM.CREATE.{name}", config, timeout=15)
        took.append((time.perf_counter() - t) * 1000)
        if "error" in r:
            raise RuntimeError(f"{cl.kind}: create {name}: {r['error']}")
    updated = []
    for i in range(n):
        name = f"r{replicas}s{i}"
        config = {"name": name, "subjects": [f"{name}.>"], "num_replicas": replicas, "storage": "file",
                  "max_msgs": 1000 + i}
        t = time.perf_counter()
        r = await api(nc, f"$JS.API.STREAM.UPDATE.{name}", config, timeout=15)
        updated.append((time.perf_counter() - t) * 1000)
        if "error" in r:
            raise RuntimeError(f"{cl.kind}: update {name}: {r['error']}")
    await nc.close()
    took.sort()
    updated.sort()
    return (statistics.median(took), took[int(len(took) * 0.9)],
            statistics.median(updated), updated[int(len(updated) * 0.9)])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--out")
    a = ap.parse_args()
    got = {}
    for kind, binary in (("keel", KEEL), ("nats", NATS)):
        cl = Cluster(kind, binary)
        try:
            cl.start()
            cl.wait_meta()
            for replicas in (1, 3):
                got[(kind, replicas)] = asyncio.run(creates(cl, a.streams, replicas))
                med, p90, umed, up90 = got[(kind, replicas)]
                print(f"{kind} R{replicas}: create median {med:.1f} ms, p90 {p90:.1f} ms; "
                      f"update median {umed:.1f} ms, p90 {up90:.1f} ms", flush=True)
        finally:
            cl.cleanup()
    lines = [f"stream create and update on 3-node clusters, {a.streams} file streams each, one at a time"]
    lines.append(f"{'':10} {'keel median/p90 ms':>20} {'nats-server':>14} {'ratio (median)':>15}")
    for what, at in (("create", 0), ("update", 2)):
        for replicas in (1, 3):
            k, n = got[("keel", replicas)][at:at + 2], got[("nats", replicas)][at:at + 2]
            lines.append(
                f"{what} R{replicas:<2} {k[0]:>11.1f} / {k[1]:<6.1f} {n[0]:>6.1f} / {n[1]:<6.1f}"
                f" {k[0] / n[0]:>10.2f}x"
            )
    report(lines, a.out)


if __name__ == "__main__":
    main()

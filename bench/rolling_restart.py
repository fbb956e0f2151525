#!/usr/bin/env python3
"""A rolling restart of a 3-node cluster (separate processes), keel-server vs nats-server
(its defaults), in one run: how long an R3 file stream takes no publishes while the server
leading it is stopped with SIGTERM, as an upgrade does server by server.

For each server in turn, on a fresh cluster: the stream `roll` (R3, file) is created; then
--rounds times: a publisher connected to a server that stays up publishes one message at a
time (each waits for its PubAck, 0.25 s timeout, retried at once on a timeout or error);
after 2 s the stream's leader gets SIGTERM and the publisher goes on for --after seconds;
the stopped server is started again and the next round waits until the stream has a
leader with every replica current. Reported per round: the longest time between two
PubAcks (the gap a publisher sees).
At the end every acked message is checked to be in the stream (STREAM.INFO message count
against the distinct acked sequences).

Usage: bench/rolling_restart.py [--rounds 3] [--after 6] [--out FILE]
"""

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import KEEL, NATS, Cluster, api, connect, create_stream, replicas_current  # noqa: E402

STREAM = "roll"


async def publish_for(nc, seconds, stop_at, acked):
    """Publishes until `seconds` have passed; returns the longest gap between acks."""
    js = nc.jetstream(timeout=0.25)
    start = time.monotonic()
    last_ack = start
    gap = 0.0
    n = 0
    while time.monotonic() - start < seconds:
        if stop_at is not None and time.monotonic() - start >= stop_at[0]:
            stop_at[1]()  # the SIGTERM, once (it returns at once; the exit is waited for apart)
            stop_at = None
        try:
            ack = await js.publish("roll.x", f"m{n}".encode())
            now = time.monotonic()
            gap = max(gap, now - last_ack)
            last_ack = now
            acked.add(ack.seq)
            n += 1
        except Exception:  # noqa: BLE001 - no leader, timeout, no responders: try again
            await asyncio.sleep(0)
    return max(gap, time.monotonic() - last_ack)


async def current(nc, timeout=60):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            info = await api(nc, f"$JS.API.STREAM.INFO.{STREAM}", None, 2)
            if replicas_current(info):
                return info["cluster"]["leader"]
        except Exception:  # noqa: BLE001
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("stream replicas not current")


def run_one(label, kind, binary, args):
    print(f"== {label}", flush=True)
    cl = Cluster(kind, binary)
    rows = []
    acked = set()
    try:
        cl.start()
        cl.wait_meta()

        async def setup():
            nc = await connect(cl.urls())
            await create_stream(
                nc, {"name": STREAM, "subjects": ["roll.>"], "storage": "file", "num_replicas": 3}
            )
            leader = await current(nc)
            await nc.close()
            return leader

        leader = asyncio.run(setup())
        for rnd in range(args.rounds):
            node = cl.by_name(leader)
            stay = next(n for n in cl.nodes if n is not node)

            def sigterm():
                node.proc.send_signal(15)

            async def step():
                nc = await connect([stay.url])
                gap = await publish_for(nc, 2.0 + args.after, [2.0, sigterm], acked)
                await nc.close()
                return gap

            gap = asyncio.run(step())
            node.proc.wait(60)
            node.start()
            node.wait_port()

            async def settle():
                nc = await connect([stay.url])
                lead = await current(nc)
                await nc.close()
                return lead

            new_leader = asyncio.run(settle())
            rows.append((rnd, leader, gap))
            print(f"   round {rnd}: stopped {leader}; longest gap between PubAcks {gap * 1000:.0f} ms", flush=True)
            leader = new_leader

        async def count():
            nc = await connect(cl.urls())
            info = await api(nc, f"$JS.API.STREAM.INFO.{STREAM}", None, 5)
            await nc.close()
            return info["state"]["messages"], info["state"]["last_seq"]

        msgs, last = asyncio.run(count())
        missing = len([s for s in acked if s > last])
        return {"gaps": [g for _, _, g in rows], "acked": len(acked), "msgs": msgs, "missing": missing}
    finally:
        cl.cleanup()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after", type=float, default=6.0, help="seconds of publishing after the SIGTERM")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    started = time.time()
    k = run_one("keel", "keel", KEEL, args)
    n = run_one("nats-server", "nats", NATS, args)
    lines = [
        f"rolling_restart.py ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s; 2 cores shared by the 3 servers and the client)",
        "3 separate processes, R3 file stream; each round: SIGTERM to the stream's leader while a",
        "client on another server publishes one message at a time (0.25 s PubAck timeout, retried);",
        "the stopped server restarts and the next round waits for every replica to be current.",
        "",
        f"{'':34}{'keel':>10}{'nats':>10}",
    ]
    for i in range(args.rounds):
        lines.append(
            f"{'round ' + str(i) + ' longest PubAck gap (ms)':34}"
            f"{k['gaps'][i] * 1000:>10.0f}{n['gaps'][i] * 1000:>10.0f}"
        )
    lines.append(f"{'acked publishes':34}{k['acked']:>10}{n['acked']:>10}")
    lines.append(f"{'messages in the stream':34}{k['msgs']:>10}{n['msgs']:>10}")
    lines.append(f"{'acked seqs past the last (lost)':34}{k['missing']:>10}{n['missing']:>10}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

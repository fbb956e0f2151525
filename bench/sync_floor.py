#!/usr/bin/env python3
"""How close a publisher waiting for each ack gets to the disk's floor, keel-server and
nats-server side by side in one run.

Measures, in one run and on the filesystem of --dir:
  * the disk's own fdatasync latency: 128-byte appends to a preallocated file, each
    followed by fdatasync (what one acknowledged message costs at least);
  * per server, on a fresh store in --dir:
      - core request/reply latency (`keel bench request`, one requester);
      - one publisher waiting for each ack (`keel bench js pub`, file stream): p50/p99
        and the server's CPU time (utime + stime, all threads) and context switches per
        message;
      - --pubs publishers each waiting for its own ack (many services, one stream):
        throughput and server CPU per message.
Keel syncs before every ack (its default); nats-server runs with its defaults (lazy
sync), as a user would.

The target (issue 11): keel's single-publisher p50 <= 1.25 x (fdatasync p50 + keel's
request/reply p50), keel's CPU per sync publish <= 2 x the reference's, and keel's
throughput with --pubs publishers >= the reference's. Rounds alternate the servers'
order; medians are printed.

Usage: bench/sync_floor.py [--rounds 3] [--msgs 5000] [--pubs 64] [--dir DIR]
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from procstat import free_port, cpu_ticks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fdatasync_us(d, n):
    path = os.path.join(d, "fdatasync.probe")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.posix_fallocate(fd, 0, 64 << 20)
        os.fsync(fd)
        rec = b"x" * 168
        lat = []
        for i in range(n):
            t = time.perf_counter()
            os.pwrite(fd, rec, 4096 + i * len(rec))
            os.fdatasync(fd)
            lat.append((time.perf_counter() - t) * 1e6)
    finally:
        os.close(fd)
        os.remove(path)
    lat.sort()
    return lat[len(lat) // 2]


def ctx_switches(pid):
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                for line in f:
                    if "ctxt_switches" in line:
                        n += int(line.split()[1])
        except OSError:
            pass
    return n


def bench(keel, url, args):
    r = subprocess.run([keel, "-s", url, "--timeout", "30s", "bench", "--json"] + args,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{args}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def run_server(name, binary, keel, args, work):
    store = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    try:
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.01)
        hz = os.sysconf("SC_CLK_TCK")
        r = bench(keel, url, ["request", "--msgs", str(args.msgs), "--size", "128"])
        out["rr_p50_us"] = r["latency_us"]["p50"]
        bench(keel, url, ["js", "pub", "--msgs", "200", "--size", "128"])  # warm up
        t0, c0 = cpu_ticks(proc.pid), ctx_switches(proc.pid)
        r = bench(keel, url, ["js", "pub", "--msgs", str(args.msgs), "--size", "128"])
        t1, c1 = cpu_ticks(proc.pid), ctx_switches(proc.pid)
        out["sync_p50_us"] = r["latency_us"]["p50"]
        out["sync_p99_us"] = r["latency_us"]["p99"]
        out["sync_cpu_us"] = (t1 - t0) / hz * 1e6 / args.msgs
        out["sync_ctx_per_msg"] = (c1 - c0) / args.msgs
        m = args.msgs * 10
        t0 = cpu_ticks(proc.pid)
        r = bench(keel, url, ["js", "pub", "--msgs", str(m), "--size", "128", "--pubs",
                              str(args.pubs)])
        t1 = cpu_ticks(proc.pid)
        out["many_msgs_per_s"] = r["pub"]["msgs_per_s"]
        out["many_p50_us"] = r["latency_us"]["p50"]
        out["many_cpu_us"] = (t1 - t0) / hz * 1e6 / m
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(store, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--msgs", type=int, default=5000)
    ap.add_argument("--pubs", type=int, default=64)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    keel = os.environ.get("KEEL_BIN", os.path.join(ROOT, "target/release/keel"))
    servers = {
        "keel": os.environ.get("KEEL_SERVER_BIN", os.path.join(ROOT, "target/release/keel-server")),
        "nats": os.environ.get("NATS_SERVER_BIN", shutil.which("nats-server") or ""),
    }
    work = tempfile.mkdtemp(prefix="keel-floor-", dir=args.dir)
    runs = {"keel": [], "nats": []}
    floors = []
    try:
        for rnd in range(args.rounds):
            floors.append(fdatasync_us(work, 2000))
            order = ["keel", "nats"] if rnd % 2 == 0 else ["nats", "keel"]
            for name in order:
                r = run_server(name, servers[name], keel, args, work)
                runs[name].append(r)
                print(f"round {rnd + 1} {name}: {r}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda name, k: statistics.median(r[k] for r in runs[name])
    fsync = statistics.median(floors)
    rows = [
        ("core request/reply p50, us", "rr_p50_us"),
        ("1 publisher, ack per message: p50, us", "sync_p50_us"),
        ("1 publisher: p99, us", "sync_p99_us"),
        ("1 publisher: server CPU per message, us", "sync_cpu_us"),
        ("1 publisher: server context switches per message", "sync_ctx_per_msg"),
        (f"{args.pubs} publishers, each waiting for its ack: msgs/s", "many_msgs_per_s"),
        (f"{args.pubs} publishers: p50, us", "many_p50_us"),
        (f"{args.pubs} publishers: server CPU per message, us", "many_cpu_us"),
    ]
    print(f"\nfdatasync p50 on this disk: {fsync:.0f} us (median of {args.rounds})")
    print("\n| | keel (fsync before every ack) | nats-server (default, lazy sync) | keel/nats |")
    print("|---|---|---|---|")
    for label, k in rows:
        a, b = med("keel", k), med("nats", k)
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {a / b:.2f} |")
    floor = fsync + med("keel", "rr_p50_us")
    print(f"\nfloor = fdatasync p50 + request/reply p50 = {floor:.0f} us; keel p50 / floor = "
          f"{med('keel', 'sync_p50_us') / floor:.2f} (target <= 1.25)")
    print(f"keel CPU per sync publish / reference's = "
          f"{med('keel', 'sync_cpu_us') / med('nats', 'sync_cpu_us'):.2f} (target <= 2)")
    print(f"{args.pubs} publishers, keel / reference throughput = "
          f"{med('keel', 'many_msgs_per_s') / med('nats', 'many_msgs_per_s'):.2f} (target >= 1)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fdatasync_us": floors, "runs": runs, "args": vars(args)}, f)


if __name__ == "__main__":
    main()

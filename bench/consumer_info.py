"""Consumer info latency as the stream grows, keel-server vs nats-server.

For each stream size (10k, 100k, 1M messages of 128 B on 100 subjects) it creates two
durables (unfiltered, and filtered on one subject), pulls and acks a few messages, then
times 300 CONSUMER.INFO requests per consumer and prints p50/p99 in microseconds.
Usage: python3 bench/consumer_info.py [keel_server_bin] [nats_server_bin]
"""
import asyncio, os, shutil, socket, subprocess, sys, tempfile, time

import nats
from procstat import free_port  # noqa: E402

KEEL = sys.argv[1] if len(sys.argv) > 1 else "target/release/keel-server"
NATS = sys.argv[2] if len(sys.argv) > 2 else shutil.which("nats-server")
SIZES = [10_000, 100_000, 1_000_000]


async def fill(js, subject_count, n):
    payload = b"x" * 128
    pending = []
    for i in range(n):
        pending.append(js.publish(f"ci.{i % subject_count}", payload))
        if len(pending) == 512:
            await asyncio.gather(*pending)
            pending = []
    if pending:
        await asyncio.gather(*pending)


async def measure(port, total):
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    js = nc.jetstream(timeout=30)
    await js.add_stream(name="CI", subjects=["ci.>"])
    have = 0
    rows = []
    for n in SIZES[: SIZES.index(total) + 1]:
        await fill(js, 100, n - have)
        have = n
        out = []
        for name, filt in (("all", "ci.>"), ("one", "ci.7")):
            durable = f"{name}{n}"
            psub = await js.pull_subscribe(filt, durable=durable, stream="CI")
            for m in await psub.fetch(5, timeout=5):
                await m.ack()
            lat = []
            for _ in range(300):
                t = time.perf_counter()
                await js.consumer_info("CI", durable)
                lat.append((time.perf_counter() - t) * 1e6)
            lat.sort()
            out.append(f"{name}: p50 {lat[150]:7.0f}us p99 {lat[297]:7.0f}us")
        rows.append(f"{n:>9,} msgs  " + "   ".join(out))
    await nc.close()
    return rows


def run(binary, label):
    store = tempfile.mkdtemp()
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.01)
        for row in asyncio.run(measure(port, SIZES[-1])):
            print(f"{label:12} {row}")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    run(KEEL, "keel-server")
    run(NATS, "nats-server")

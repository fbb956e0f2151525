"""What a dashboard refresh costs keel-server, next to a /jsz request of the same data.

Starts keel-server (JetStream, monitoring on), creates STREAMS streams with
CONSUMERS_PER_STREAM durables each and some messages, waits for two sparkline samples,
then for each request kind issues N requests one after another and reports the server's
CPU time per request (utime+stime from /proc/<pid>/stat, so client work does not count),
the wall time per request and the response size:

  page refresh   GET /dashboard with the ETag the browser has (304; the script and style
                 sheet are named by content hash and cached for good, so a reload does not
                 ask for them), plus GET /dashboard/data?since=<the sample the page has>
  first load     the three assets (200) plus GET /dashboard/data (full 10-minute history)
  poll           GET /dashboard/data?since=<latest sample> (what the open page does every 2 s)
  /jsz consumers GET /jsz?consumers=true (streams and consumers, no config)
  /jsz full      GET /jsz?consumers=true&config=true

Usage: python3 bench/dashboard_cost.py [keel_server_bin] [streams] [consumers_per_stream]
"""
import asyncio, http.client, json, os, subprocess, sys, tempfile, time

import nats
from procstat import free_port, cpu_ticks  # noqa: E402

KEEL = sys.argv[1] if len(sys.argv) > 1 else "target/release/keel-server"
STREAMS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
PER_STREAM = int(sys.argv[3]) if len(sys.argv) > 3 else 50
N = int(os.environ.get("N", "500"))


def get(conn, path, headers=None):
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    body = r.read()
    return r.status, dict(r.getheaders()), body


async def setup(port):
    nc = await nats.connect(f"nats://127.0.0.1:{port}")
    js = nc.jetstream()
    for s in range(STREAMS):
        await js.add_stream(name=f"S{s}", subjects=[f"s{s}.>"], storage="file")
        for c in range(PER_STREAM):
            await js.add_consumer(f"S{s}", durable_name=f"c{c}", ack_policy="explicit")
        for i in range(20):
            await js.publish(f"s{s}.x", b"payload")
    await nc.close()


def main():
    port, mport = free_port(), free_port()
    store = tempfile.mkdtemp(prefix="keel-dash-bench-")
    proc = subprocess.Popen(
        [KEEL, "-a", "127.0.0.1", "-p", str(port), "-m", str(mport), "-js", "-sd", store],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        asyncio.run(setup(port))
        conn = http.client.HTTPConnection("127.0.0.1", mport)
        # Two samples for the sparklines (one every 5 s).
        while json.loads(get(conn, "/dashboard/data")[2])["history"]["seq"] < 2:
            time.sleep(0.5)
        etags = {}
        for a in ["/dashboard", "/dashboard/app.js", "/dashboard/app.css"]:
            etags[a] = get(conn, a)[1]["etag"]

        seq = json.loads(get(conn, "/dashboard/data")[2])["history"]["seq"]

        def refresh():
            st, _, b = get(conn, "/dashboard", {"If-None-Match": etags["/dashboard"]})
            assert st == 304, st
            size = len(b)
            # The sample the page already has: a refresh only gets what is newer.
            size += len(get(conn, f"/dashboard/data?since={seq}")[2])
            return size

        def first_load():
            return sum(len(get(conn, a)[2]) for a in etags) + len(get(conn, "/dashboard/data")[2])

        def poll():
            return len(get(conn, f"/dashboard/data?since={seq}")[2])

        kinds = [
            ("page refresh (304 + data)", refresh),
            ("first load (assets + full history)", first_load),
            ("poll (/dashboard/data)", poll),
            ("/jsz?consumers=true", lambda: len(get(conn, "/jsz?consumers=true")[2])),
            ("/jsz?consumers=true&config=true",
             lambda: len(get(conn, "/jsz?consumers=true&config=true")[2])),
        ]
        hz = os.sysconf("SC_CLK_TCK")
        print(f"keel-server, {STREAMS} streams x {PER_STREAM} consumers = "
              f"{STREAMS * PER_STREAM} consumers, {N} requests each")
        print(f"{'request':40} {'server CPU/req':>15} {'wall/req':>10} {'bytes':>10}")
        for name, fn in kinds:
            fn()  # warm up
            c0, t0 = cpu_ticks(proc.pid), time.perf_counter()
            for _ in range(N):
                size = fn()
            c1, t1 = cpu_ticks(proc.pid), time.perf_counter()
            cpu_ms = (c1 - c0) / hz / N * 1000
            print(f"{name:40} {cpu_ms:12.2f} ms {(t1 - t0) / N * 1000:7.2f} ms {size:10}")
    finally:
        proc.terminate()
        proc.wait()
        subprocess.run(["rm", "-rf", store])


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Restart time with a large file stream, keel-server vs nats-server, side by side.
# Fills a stream with N messages of 128 B (default 1,000,000), then for each way of stopping
# (SIGTERM: clean, SIGKILL: crash) restarts the server on the same store and measures the
# time from process start until STREAM.INFO answers with every message there.
# Usage: bench/restart.sh [N]      (needs target/release/{keel-server,keel}: cargo build --release)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000000}
KEEL_SERVER=${KEEL_SERVER_BIN:-target/release/keel-server}
NATS_SERVER=${NATS_SERVER_BIN:-$(command -v nats-server)}
KEEL=${KEEL_BIN:-target/release/keel}
WORK=$(mktemp -d)
PID=
cleanup() { [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

start() { # bin store port
  "$1" -a 127.0.0.1 -p "$3" -js -sd "$2" >"$WORK/log" 2>&1 &
  PID=$!
}

# Seconds (float) until the stream reports N messages.
wait_ready() { # port
  python3 - "$1" "$N" <<'EOF'
import asyncio, sys, time
import nats
port, n = int(sys.argv[1]), int(sys.argv[2])
async def main():
    t0 = time.monotonic()
    while True:
        try:
            nc = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=0.2,
                                    allow_reconnect=False, max_reconnect_attempts=0)
            js = nc.jetstream(timeout=1)
            while True:
                try:
                    si = await js.stream_info("RESTART")
                    if si.state.messages >= n:
                        print(f"{time.monotonic() - t0:.3f}")
                        await nc.close()
                        return
                except Exception:
                    pass
                await asyncio.sleep(0.005)
        except Exception:
            await asyncio.sleep(0.005)
asyncio.run(main())
EOF
}

run() { # name bin
  local name=$1 bin=$2 store="$WORK/$1-store" port
  port=$(free_port)
  start "$bin" "$store" "$port"
  # Acknowledged async publishes into a file stream that is kept afterwards.
  "$KEEL" -s "nats://127.0.0.1:$port" bench js pub-async restart --stream RESTART \
    --storage file --msgs "$N" --size 128 --keep >/dev/null
  wait_ready "$port" >/dev/null
  local du
  du=$(du -sh "$store" | cut -f1)
  for sig in TERM KILL; do
    kill -"$sig" "$PID"; wait "$PID" 2>/dev/null || true
    local t0 t1
    t0=$(date +%s.%N)
    start "$bin" "$store" "$port"
    local ready
    ready=$(wait_ready "$port")
    t1=$(date +%s.%N)
    printf '%-12s %-8s %10s msgs  store %-6s ready after %ss (from exec: %.3fs)\n' \
      "$name" "SIG$sig" "$N" "$du" "$ready" "$(echo "$t1 - $t0" | bc)"
  done
  kill -TERM "$PID"; wait "$PID" 2>/dev/null || true; PID=
}

run keel-server "$KEEL_SERVER"
run nats-server "$NATS_SERVER"

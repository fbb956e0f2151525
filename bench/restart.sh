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

# Starts the server and prints seconds from exec until STREAM.INFO shows all N messages
# (the Python side is fully loaded before the clock starts), then the server's pid.
restart_timed() { # bin store port
  python3 - "$1" "$2" "$3" "$N" "$WORK/log" <<'EOF'
import asyncio, socket, subprocess, sys, time
import nats
binary, store, port, n, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t0 = time.monotonic()
proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                        stdout=open(log, "w"), stderr=subprocess.STDOUT)
while True:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
        break
    except OSError:
        time.sleep(0.001)
async def main():
    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    js = nc.jetstream(timeout=2)
    while True:
        try:
            si = await js.stream_info("RESTART")
            if si.state.messages >= n:
                print(f"{time.monotonic() - t0:.3f} {proc.pid}")
                await nc.close()
                return
        except Exception:
            pass
        await asyncio.sleep(0.001)
asyncio.run(main())
EOF
}

wait_port() { # port
  until python3 -c "import socket;socket.create_connection(('127.0.0.1',$1),0.1)" 2>/dev/null; do sleep 0.01; done
}

run() { # name bin
  local name=$1 bin=$2 store="$WORK/$1-store" port
  port=$(free_port)
  start "$bin" "$store" "$port"
  wait_port "$port"
  # Acknowledged async publishes into a file stream that is kept afterwards.
  "$KEEL" -s "nats://127.0.0.1:$port" bench js pub-async restart --stream RESTART \
    --storage file --msgs "$N" --size 128 --keep >/dev/null
  local du
  du=$(du -sh "$store" | cut -f1)
  for sig in TERM KILL; do
    kill -"$sig" "$PID"; wait "$PID" 2>/dev/null || true
    local out
    out=$(restart_timed "$bin" "$store" "$port")
    PID=${out#* }
    printf '%-12s after SIG%-5s %10s msgs  store %-5s  exec -> all messages served: %ss\n' \
      "$name" "$sig" "$N" "$du" "${out% *}"
  done
  kill -TERM "$PID"; wait "$PID" 2>/dev/null || true; PID=
}

run keel-server "$KEEL_SERVER"
run nats-server "$NATS_SERVER"

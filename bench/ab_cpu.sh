#!/usr/bin/env bash
# Direct A/B of two keel-server builds on the same `keel bench` scenarios.
#
#   bench/ab_cpu.sh BEFORE_BIN AFTER_BIN
#
# For each scenario and round the two servers run in turn (the order alternates every
# round), each on a free loopback port with JetStream on a fresh store directory. Measured
# per run: the server's CPU time (utime+stime from /proc/<pid>/stat, in clock ticks,
# usually 10 ms) while the scenario ran, and the client-measured rate. Prints the medians
# and after/before ratios. On a machine shared with other work the rate swings a lot
# (compare.sh's spread column shows it); the server's CPU per run is the steadier number.
#
# Environment knobs:
#   ROUNDS=6          rounds per scenario
#   KEEL=...          the bench client (default: <target>/release/keel)
#   ONLY=REGEX        run only the scenarios whose name matches (bash regex)
set -euo pipefail

[[ $# == 2 ]] || { echo "usage: $0 BEFORE_BIN AFTER_BIN" >&2; exit 2; }
BEFORE=$1
AFTER=$2
ROUNDS=${ROUNDS:-6}
cd "$(dirname "$0")/.."
KEEL=${KEEL:-${CARGO_TARGET_DIR:-$PWD/target}/release/keel}
for b in "$BEFORE" "$AFTER" "$KEEL"; do
    [[ -x $b ]] || { echo "ab_cpu.sh: $b is not an executable" >&2; exit 1; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/keel-ab.XXXXXX")
RESULTS=$WORK/results.tsv
: >"$RESULTS"
PID=""
stop() {
    if [[ -n $PID ]]; then
        kill "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
        PID=""
    fi
}
trap 'stop; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cpu_ticks() { # utime + stime of a pid (fields 14 and 15; the name has no spaces)
    awk '{print $14 + $15}' "/proc/$1/stat"
}

start() { # bin: sets PID and URL
    local port store i
    port=$(free_port)
    store=$(mktemp -d "$WORK/store.XXXXXX")
    "$1" -a 127.0.0.1 -p "$port" -js -sd "$store" >"$WORK/server.log" 2>&1 &
    PID=$!
    URL=nats://127.0.0.1:$port
    for ((i = 0; i < 200; i++)); do
        kill -0 "$PID" 2>/dev/null || { tail -5 "$WORK/server.log" >&2; exit 1; }
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.05
    done
    echo "ab_cpu.sh: $1 did not start" >&2
    exit 1
}

SCENARIOS=(
    "pub-128B|pub --msgs 2000000 --size 128"
    "pubsub-128B-1:1|pubsub --msgs 500000 --size 128"
    "pubsub-128B-1:4|pubsub --msgs 200000 --size 128 --subs 4"
    "js-pub-async-128B|js pub-async --msgs 200000 --size 128 --inflight 256"
)

echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for entry in "${SCENARIOS[@]}"; do
    scen=${entry%%|*}
    args=${entry#*|}
    [[ -z ${ONLY:-} || $scen =~ $ONLY ]] || continue
    for ((round = 1; round <= ROUNDS; round++)); do
        if ((round % 2)); then order="before after"; else order="after before"; fi
        for which in $order; do
            if [[ $which == before ]]; then bin=$BEFORE; else bin=$AFTER; fi
            start "$bin"
            t0=$(cpu_ticks "$PID")
            # shellcheck disable=SC2086 # args is a word list on purpose
            if out=$("$KEEL" -s "$URL" --timeout 10s bench --json $args 2>"$WORK/err"); then
                t1=$(cpu_ticks "$PID")
                printf '%s\t%s\t%s\t%s\n' "$scen" "$which" "$((t1 - t0))" "$out" >>"$RESULTS"
            else
                echo "  $scen ($which) FAILED: $(tail -1 "$WORK/err")" >&2
            fi
            stop
        done
    done
    echo "  $scen: $ROUNDS rounds done" >&2
done

python3 - "$RESULTS" "$ROUNDS" <<'PY'
import json, statistics, sys
path, rounds = sys.argv[1], sys.argv[2]
runs = {}
order = []
for line in open(path):
    scen, which, ticks, raw = line.rstrip("\n").split("\t", 3)
    d = json.loads(raw)
    # Pub/sub: the subscribers' rate; publish scenarios: the publisher's.
    rate = (d["sub"] if "sub" in d else d["pub"])["msgs_per_s"]
    runs.setdefault((scen, which), []).append((int(ticks), rate))
    if scen not in order:
        order.append(scen)
print(f"medians of {rounds} rounds (server CPU in clock ticks per run; msgs/s as the client saw it)")
print(f"{'scenario':20} {'cpu before':>10} {'cpu after':>10} {'ratio':>6}   {'msgs/s before':>14} {'msgs/s after':>14} {'ratio':>6}")
for scen in order:
    b = runs.get((scen, "before"), [])
    a = runs.get((scen, "after"), [])
    if not a or not b:
        continue
    cb, ca = statistics.median(t for t, _ in b), statistics.median(t for t, _ in a)
    rb, ra = statistics.median(r for _, r in b), statistics.median(r for _, r in a)
    print(f"{scen:20} {cb:>10.1f} {ca:>10.1f} {ca / cb:>6.2f}   {rb:>14,.0f} {ra:>14,.0f} {ra / rb:>6.2f}")
PY

#!/usr/bin/env bash
# Publish throughput with permissions on vs off, side by side, on one keel-server build.
#
#   bench/permissions.sh [KEEL_SERVER_BIN]
#
# "off": no authorization at all. "on": the publisher and subscribers are users with publish
# and subscribe allow lists and deny rules (so every publish goes through the permission
# check, answered from the connection's cache, and every delivery asks the subscriber's deny
# rules). For each scenario and round both run in turn (the order alternates every round),
# each on a fresh server on a free loopback port. Prints the medians of the client-measured
# rate and of the server's CPU time per run, and on/off ratios. Permission checks are meant
# to be within noise: a ratio near 1.00 (the spread column says how noisy the machine is).
#
# Environment knobs: ROUNDS=6, KEEL=<target>/release/keel (the bench client), ONLY=REGEX.
set -euo pipefail

cd "$(dirname "$0")/.."
SERVER=${1:-${CARGO_TARGET_DIR:-$PWD/target}/release/keel-server}
KEEL=${KEEL:-${CARGO_TARGET_DIR:-$PWD/target}/release/keel}
ROUNDS=${ROUNDS:-6}
for b in "$SERVER" "$KEEL"; do
    [[ -x $b ]] || { echo "permissions.sh: $b is not an executable (cargo build --release -p keel-server -p keel-cli)" >&2; exit 1; }
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/keel-perm.XXXXXX")
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

cat >"$WORK/on.conf" <<'EOF'
authorization {
  users = [
    {user: bench, password: bench, permissions: {
      publish: {allow: ["keel.>", "_INBOX.>"], deny: ["keel.secret.>"]}
      subscribe: {allow: ["keel.>", "_INBOX.>"], deny: ["keel.secret.>"]}
    }}
  ]
}
EOF

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cpu_ticks() { # utime + stime of a pid
    awk '{print $14 + $15}' "/proc/$1/stat"
}

start() { # mode: sets PID, URL and CREDS
    local port i
    port=$(free_port)
    if [[ $1 == on ]]; then
        "$SERVER" -a 127.0.0.1 -p "$port" -c "$WORK/on.conf" >"$WORK/server.log" 2>&1 &
        CREDS=(--user bench --password bench)
    else
        "$SERVER" -a 127.0.0.1 -p "$port" >"$WORK/server.log" 2>&1 &
        CREDS=()
    fi
    PID=$!
    URL=nats://127.0.0.1:$port
    for ((i = 0; i < 200; i++)); do
        kill -0 "$PID" 2>/dev/null || { tail -5 "$WORK/server.log" >&2; exit 1; }
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.05
    done
    echo "permissions.sh: server did not start" >&2
    exit 1
}

SCENARIOS=(
    "pub-128B|pub keel.bench --msgs 2000000 --size 128"
    "pub-128B-2pubs|pub keel.bench --msgs 2000000 --size 128 --clients 2"
    "pubsub-128B-1:1|pubsub keel.bench --msgs 500000 --size 128"
    "pubsub-128B-1:4|pubsub keel.bench --msgs 200000 --size 128 --subs 4"
)

echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for entry in "${SCENARIOS[@]}"; do
    scen=${entry%%|*}
    args=${entry#*|}
    [[ -z ${ONLY:-} || $scen =~ $ONLY ]] || continue
    for ((round = 1; round <= ROUNDS; round++)); do
        if ((round % 2)); then order="off on"; else order="on off"; fi
        for mode in $order; do
            start "$mode"
            t0=$(cpu_ticks "$PID")
            # shellcheck disable=SC2086 # args is a word list on purpose
            if out=$("$KEEL" -s "$URL" "${CREDS[@]}" --timeout 10s bench --json $args 2>"$WORK/err"); then
                t1=$(cpu_ticks "$PID")
                printf '%s\t%s\t%s\t%s\n' "$scen" "$mode" "$((t1 - t0))" "$out" >>"$RESULTS"
            else
                echo "  $scen ($mode) FAILED: $(tail -1 "$WORK/err")" >&2
            fi
            stop
        done
    done
    echo "  $scen: $ROUNDS rounds done" >&2
done

python3 - "$RESULTS" "$ROUNDS" <<'PY'
import json, statistics, sys
path, rounds = sys.argv[1], sys.argv[2]
runs, order = {}, []
for line in open(path):
    scen, mode, ticks, raw = line.rstrip("\n").split("\t", 3)
    d = json.loads(raw)
    rate = (d["sub"] if "sub" in d else d["pub"])["msgs_per_s"]
    runs.setdefault((scen, mode), []).append((int(ticks), rate))
    if scen not in order:
        order.append(scen)
def spread(xs):
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0
print(f"medians of {rounds} rounds; msgs/s as the client saw it (pubsub: the subscribers'), server CPU in clock ticks per run")
print(f"{'scenario':18} {'msgs/s off':>12} {'msgs/s on':>12} {'on/off':>7} {'spread off/on':>14}   {'cpu off':>8} {'cpu on':>8} {'on/off':>7}")
for scen in order:
    off, on = runs.get((scen, "off"), []), runs.get((scen, "on"), [])
    if not off or not on:
        continue
    r0, r1 = statistics.median(r for _, r in off), statistics.median(r for _, r in on)
    c0, c1 = statistics.median(t for t, _ in off), statistics.median(t for t, _ in on)
    s = f"{spread([r for _, r in off]):.0%}/{spread([r for _, r in on]):.0%}"
    print(f"{scen:18} {r0:>12,.0f} {r1:>12,.0f} {r1 / r0:>7.2f} {s:>14}   {c0:>8.1f} {c1:>8.1f} {c1 / c0:>7.2f}")
PY

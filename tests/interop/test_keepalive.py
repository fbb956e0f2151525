"""Server-initiated PING and stale-connection detection (captures/core/server_ping.txt)."""

from __future__ import annotations

import asyncio
import time

import pytest

from raw import ConnectionClosed

PING_INTERVAL = 1.0
PING_MAX = 2
DEADLINE = 10.0  # the stale client must be gone well within this


@pytest.mark.server_config(ping_interval="1s", ping_max=PING_MAX)
async def test_stale_connection_after_unanswered_pings(raw):
    # a well-behaved client on the same server answers PINGs (in the background) and must
    # stay connected
    good = await raw()
    good_ops = []

    async def pump():
        while True:
            good_ops.append(await good.read_op(timeout=60))  # PINGs are answered inside read_op

    pump_task = asyncio.create_task(pump())
    stale = await raw()
    stale.auto_pong = False  # never answer the server's PINGs
    t0 = time.monotonic()

    seen = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while True:
        remaining = deadline - loop.time()
        assert remaining > 0, f"no 'Stale Connection' within {DEADLINE}s; got {seen!r}"
        try:
            op = await stale.read_op(timeout=remaining)
        except ConnectionClosed:
            pytest.fail(f"closed without -ERR 'Stale Connection'; got {seen!r}")
        seen.append(op.raw)
        if op.name == "-ERR":
            break
    elapsed = time.monotonic() - t0

    assert seen[-1] == b"-ERR 'Stale Connection'\r\n"
    assert seen[:-1] == [b"PING\r\n"] * PING_MAX, (
        f"expected {PING_MAX} unanswered PINGs before the stale error, got {seen!r}")
    # ping_max PINGs go out one interval apart, the stale verdict comes one interval later
    assert elapsed >= PING_MAX * PING_INTERVAL * 0.8, f"declared stale too early ({elapsed:.2f}s)"
    rest = await stale.read_to_eof(timeout=5)
    assert rest == b"", f"unexpected bytes after the stale error: {rest!r}"

    # the answering client keeps being pinged past ping_max intervals and is still alive
    try:
        while good.server_pings <= PING_MAX:
            assert loop.time() < deadline + 3, f"answering client got only {good.server_pings} PINGs"
            assert not pump_task.done(), f"answering client failed: {pump_task!r} {good_ops!r}"
            await asyncio.wait([pump_task], timeout=0.1)  # poll the condition
    finally:
        pump_task.cancel()
        await asyncio.gather(pump_task, return_exceptions=True)
    assert good_ops == [], good_ops
    assert await good.flush() == []
    await good.send(b"SUB k.x 1\r\nPUB k.x 2\r\nok\r\n")
    assert [o.raw for o in await good.flush()] == [b"MSG k.x 1 2\r\nok\r\n"]

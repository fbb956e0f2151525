"""Slow consumer: a subscriber that never reads is disconnected; everybody else carries on.

What makes the reference (nats-server 2.15.1) disconnect reliably and quickly:
  * `write_deadline: "2s"`: once the subscriber's TCP window is full the server's write
    blocks; after 2 s it logs "Slow Consumer Detected: WriteDeadline of 2s exceeded" and
    closes the connection.  (The default write_deadline is 10 s, which also works but is slow.)
  * 64 MiB in 64 KiB messages: only ~5-8 MiB fit in the kernel socket buffers, so the
    server is left holding tens of MiB for the subscriber.  This stays below the default
    `max_pending` (64 MiB), i.e. it is the write deadline, not the pending limit, that fires.
  Measured: disconnect ~2.0-2.3 s after the flood starts; the whole test takes ~3 s.

How the test sees the disconnect without reading from the slow socket (reading would
relieve the pressure): the slow client's subscription is the only interest on `slow.>`,
so once the server has dropped it a request to `slow.probe` gets an immediate
no-responders error (before that the request is delivered to the stuck subscriber and
times out).  Afterwards the slow socket is drained: it must reach EOF having received
far less than was published.
"""

from __future__ import annotations

import time

import nats.errors
import pytest

from natsutil import sync

PAYLOAD = 64 * 1024
TOTAL = 64 * 1024 * 1024
BOUND = 15.0  # the server must have dropped the slow consumer within this many seconds


@pytest.mark.server_config(write_deadline="2s")
async def test_slow_consumer_is_disconnected(connect, raw):
    slow = await raw(rcvbuf=16 * 1024)  # small receive window: the kernel absorbs little
    await slow.send(b"SUB slow.> 1\r\n")
    assert await slow.flush() == []

    publisher = await connect()
    bystander = await connect()
    other = await bystander.subscribe("other.>")
    await sync(bystander)

    t0 = time.monotonic()
    data = b"x" * PAYLOAD
    n_msgs = TOTAL // PAYLOAD
    for _ in range(n_msgs):
        await publisher.publish("slow.data", data)
    await sync(publisher, timeout=BOUND)  # the server has taken all 64 MiB from the publisher

    # while the slow consumer is stuck, other clients are served normally
    await publisher.publish("other.during", b"during")
    assert (await other.next_msg(timeout=5)).data == b"during"
    await bystander.flush(timeout=5)

    # wait (bounded) until the server has dropped the slow consumer's subscription
    disconnected_after = None
    while time.monotonic() - t0 < BOUND:
        try:
            await bystander.request("slow.probe", b"", timeout=0.5)
        except nats.errors.NoRespondersError:
            disconnected_after = time.monotonic() - t0
            break
        except nats.errors.TimeoutError:
            continue  # still subscribed (the stuck client "received" the probe)
    assert disconnected_after is not None, f"slow consumer still subscribed after {BOUND}s"

    # its socket ends in EOF after far less than was published
    received = await slow.read_to_eof(timeout=10)
    assert len(received) < TOTAL // 2, f"slow consumer received {len(received)} of {TOTAL} bytes"

    # the publisher was not punished and everything else still works
    assert publisher.is_connected and bystander.is_connected
    await publisher.flush(timeout=5)
    await publisher.publish("other.after", b"after")
    assert (await other.next_msg(timeout=5)).data == b"after"
    await bystander.flush(timeout=5)
    fresh = await raw()
    await fresh.send(b"SUB slow.> 1\r\n")
    assert await fresh.flush() == []
    await publisher.publish("slow.data", b"small")
    assert (await fresh.read_op(timeout=5)).raw == b"MSG slow.data 1 5\r\nsmall\r\n"

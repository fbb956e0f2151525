"""Consumer delivery as nats-py workers see it (issue 10): a pull request whose
requester went away (inbox unsubscribed, process SIGKILLed during a long poll) gets
nothing and counts for nothing, and consumer pause / resume / reset through nats-py's
JetStream manager.

Expectations are the reference nats-server's (KEEL_TEST_SERVER=nats).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import pytest
from nats.js import api

pytestmark = pytest.mark.jetstream

T = 5.0


async def wait_for(predicate, timeout: float = T, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {value!r})")
        await asyncio.sleep(interval)


async def setup(connect, stream="JOBS", consumer="worker", **config):
    nc = await connect()
    js = nc.jetstream(timeout=T)
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"], storage=api.StorageType.MEMORY)
    await js.add_consumer(stream, api.ConsumerConfig(
        durable_name=consumer, ack_policy=api.AckPolicy.EXPLICIT, **config,
    ))
    return nc, js


async def waiting(js, stream="JOBS", consumer="worker", n=0):
    info = await js.consumer_info(stream, consumer)
    return info if info.num_waiting == n else None


# A Go-style long poll (Fetch with MaxWait 20s) from its own process.
LONG_POLL_WORKER = r"""
import asyncio, sys, nats

async def main(url):
    nc = await nats.connect(url, allow_reconnect=False)
    js = nc.jetstream(timeout=5)
    psub = await js.pull_subscribe_bind("worker", stream="JOBS")
    print("POLLING", flush=True)
    await psub.fetch(5, timeout=20)

asyncio.run(main(sys.argv[1]))
"""


async def test_long_poll_worker_sigkilled(server, connect):
    """Seed walkthrough B: the worker is SIGKILLed during its long poll; the restarted
    worker gets all five messages published meanwhile, each a first delivery."""
    nc, js = await setup(connect)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LONG_POLL_WORKER, server.url, stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert line.decode().strip() == "POLLING"
        await wait_for(lambda: waiting(js, n=1))
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), T)
    await wait_for(lambda: waiting(js, n=0))
    for i in range(1, 6):
        await js.publish("jobs.new", f"job-{i}".encode())
    info = await js.consumer_info("JOBS", "worker")
    assert (info.num_waiting, info.num_pending, info.num_ack_pending) == (0, 5, 0)
    assert info.delivered.consumer_seq == 0

    psub = await js.pull_subscribe_bind("worker", stream="JOBS")
    msgs = await psub.fetch(5, timeout=T)
    assert [m.data for m in msgs] == [f"job-{i}".encode() for i in range(1, 6)]
    assert [m.metadata.num_delivered for m in msgs] == [1] * 5


async def test_stopped_consume_request_is_dropped(connect):
    """nats.js consume(): 30 s pull requests, then the consumer is stopped (its inbox
    unsubscribed). The next publish stays pending; nothing is counted as delivered."""
    nc, js = await setup(connect, max_deliver=3)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"batch": 100, "expires": 30_000_000_000, "idle_heartbeat": 15_000_000_000}
    await nc.publish("$JS.API.CONSUMER.MSG.NEXT.JOBS.worker", json.dumps(body).encode(), reply=inbox)
    await wait_for(lambda: waiting(js, n=1))
    await sub.unsubscribe()
    await nc.flush()
    await js.publish("jobs.new", b"job")

    async def pending():
        info = await js.consumer_info("JOBS", "worker")
        return info if info.num_pending == 1 else None

    info = await wait_for(pending)
    assert (info.num_waiting, info.num_ack_pending, info.delivered.consumer_seq) == (0, 0, 0)
    psub = await js.pull_subscribe_bind("worker", stream="JOBS")
    [m] = await psub.fetch(1, timeout=T)
    assert (m.data, m.metadata.num_delivered) == (b"job", 1)


async def test_pause_resume_and_reset(connect):
    nc, js = await setup(connect)
    for i in range(1, 4):
        await js.publish("jobs.new", f"job-{i}".encode())
    paused = await js.pause_consumer("JOBS", "worker", "2099-01-01T00:00:00Z")
    assert paused.paused is True
    assert paused.pause_until == "2099-01-01T00:00:00Z"
    info = await js.consumer_info("JOBS", "worker")
    assert info.paused is True
    assert info.config.pause_until == "2099-01-01T00:00:00Z"
    psub = await js.pull_subscribe_bind("worker", stream="JOBS")
    # Paused: a fetch gets nothing.
    with pytest.raises(Exception):
        await psub.fetch(1, timeout=0.5)

    resumed = await js.resume_consumer("JOBS", "worker")
    assert resumed.paused is False
    info = await js.consumer_info("JOBS", "worker")
    assert not info.paused
    msgs = await psub.fetch(2, timeout=T)
    assert [m.data for m in msgs] == [b"job-1", b"job-2"]
    await msgs[0].ack_sync()

    # Reset to the ack floor: job-2 is delivered again as a first delivery.
    reset = await js.reset_consumer("JOBS", "worker")
    assert reset.reset_seq == 2
    assert reset.info.num_ack_pending == 0
    [m] = await psub.fetch(1, timeout=T)
    assert (m.data, m.metadata.num_delivered) == (b"job-2", 1)
    # Reset to a sequence.
    reset = await js.reset_consumer("JOBS", "worker", seq=3)
    assert reset.reset_seq == 3
    [m] = await psub.fetch(1, timeout=T)
    assert m.data == b"job-3"

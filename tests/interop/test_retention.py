"""Interest retention as nats-py 2.16.0 drives it: a message is kept while some consumer
still has to ack it, and only for the consumers whose filter selects it; pull and push
consumers, plain acks; a deleted consumer releases its interest.

Expectations are the reference nats-server's (KEEL_TEST_SERVER=nats).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js import api

from natsutil import sync

pytestmark = pytest.mark.jetstream

T = 5.0


async def js_ctx(connect):
    nc = await connect()
    return nc, nc.jetstream(timeout=T)


async def messages(js, stream: str) -> tuple[int, int]:
    """(messages, first_seq) of a stream."""
    st = (await js.stream_info(stream)).state
    return st.messages, st.first_seq


async def wait_state(js, stream: str, want: tuple[int, int], timeout: float = T):
    """Polls stream info until (messages, first_seq) is `want`; removal after an ack is
    asynchronous in both servers."""
    deadline = time.monotonic() + timeout
    while (got := await messages(js, stream)) != want:
        assert time.monotonic() < deadline, f"stream {stream}: {got}, want {want}"
        await asyncio.sleep(0.02)


async def durable(js, stream: str, name: str, filter_subject: str | None = None):
    await js.add_consumer(stream, api.ConsumerConfig(
        durable_name=name, ack_policy=api.AckPolicy.EXPLICIT, filter_subject=filter_subject,
    ))
    return await js.pull_subscribe_bind(name, stream=stream)


async def test_interest_keeps_a_message_until_every_consumer_acked(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(
        name="IR", subjects=["ir.>"], retention=api.RetentionPolicy.INTEREST,
        storage=api.StorageType.FILE,
    )
    # Nobody interested: acknowledged, not kept.
    assert (await js.publish("ir.a", b"nobody")).seq == 1
    assert await messages(js, "IR") == (0, 2)

    first = await durable(js, "IR", "first")
    second = await durable(js, "IR", "second")
    assert (await js.publish("ir.a", b"both")).seq == 2
    assert await messages(js, "IR") == (1, 2)

    [m] = await first.fetch(1, timeout=2)
    assert m.data == b"both"
    await m.ack()  # plain +ACK
    # Once "first" has the ack, the message is still there for "second".
    deadline = time.monotonic() + T
    while (await js.consumer_info("IR", "first")).ack_floor.stream_seq != 2:
        assert time.monotonic() < deadline, "first's ack not processed"
        await asyncio.sleep(0.02)
    assert await messages(js, "IR") == (1, 2)

    [m] = await second.fetch(1, timeout=2)
    assert m.data == b"both"
    await m.ack()
    await wait_state(js, "IR", (0, 3))

    # A push consumer's acks count the same way.
    sub = await js.subscribe("ir.>", durable="pusher", manual_ack=True, stream="IR")
    await sync(nc)
    assert (await js.publish("ir.b", b"three")).seq == 3
    for psub in (first, second):
        [m] = await psub.fetch(1, timeout=2)
        await m.ack()
    pushed = await sub.next_msg(timeout=2)
    assert pushed.data == b"three"
    # Still waiting for the push consumer.
    await asyncio.sleep(0.1)
    assert await messages(js, "IR") == (1, 3)
    await pushed.ack()
    await wait_state(js, "IR", (0, 4))


async def test_interest_follows_consumer_filters(connect):
    """`orders.>` does not select `orders`: a consumer filtered on it holds no message on
    `orders`, and one on `orders.new` waits for it too."""
    nc, js = await js_ctx(connect)
    await js.add_stream(
        name="IF", subjects=["orders", "orders.>"], retention=api.RetentionPolicy.INTEREST,
    )
    worker = await durable(js, "IF", "worker", filter_subject="orders.>")
    assert (await js.publish("orders", b"bare")).seq == 1
    assert await messages(js, "IF") == (0, 2)  # only "worker", which does not want it
    assert (await js.publish("orders.new", b"new")).seq == 2
    assert await messages(js, "IF") == (1, 2)

    audit = await durable(js, "IF", "audit")
    assert (await js.publish("orders", b"bare2")).seq == 3
    assert await messages(js, "IF") == (2, 2)
    got = await audit.fetch(2, timeout=2)
    assert [(m.subject, m.data) for m in got] == [("orders.new", b"new"), ("orders", b"bare2")]
    for m in got:
        await m.ack()
    # seq 3 was only audit's; seq 2 still waits for worker.
    await wait_state(js, "IF", (1, 2))
    [m] = await worker.fetch(1, timeout=2)
    assert (m.subject, m.data) == ("orders.new", b"new")
    await m.ack()
    await wait_state(js, "IF", (0, 4))


async def test_deleting_a_consumer_releases_its_interest(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="ID", subjects=["id.>"], retention=api.RetentionPolicy.INTEREST)
    keeper = await durable(js, "ID", "keeper")
    await durable(js, "ID", "leaver")
    for i in range(3):
        await js.publish("id.x", f"m{i}".encode())
    for m in await keeper.fetch(3, timeout=2):
        await m.ack()
    # "leaver" never acked: everything is still there.
    deadline = time.monotonic() + T
    while (await js.consumer_info("ID", "keeper")).ack_floor.stream_seq != 3:
        assert time.monotonic() < deadline, "keeper's acks not processed"
        await asyncio.sleep(0.02)
    assert await messages(js, "ID") == (3, 1)
    assert await js.delete_consumer("ID", "leaver")
    await wait_state(js, "ID", (0, 4))

"""JetStream consumers as nats-py 2.16.0 drives them: pull subscribe + fetch + ack,
durable resume after a killed worker / a SIGKILLed server (walkthrough 1), push
subscribe (plain and queue), nak / nak with delay / in_progress / term, consumer
info fields, ordered consumers, and KV watch / history / keys.

Expectations are the reference nats-server's (KEEL_TEST_SERVER=nats runs
the same tests against it).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

pytestmark = pytest.mark.jetstream

T = 5.0

# The reference flushes consumer ack state asynchronously; acks SIGKILLed
# within ~50 ms were lost in observation. Wait this long before a SIGKILL.
PERSIST_SETTLE = 1.0


async def js_ctx(connect):
    nc = await connect()
    return nc, nc.jetstream(timeout=T)


async def js_request(nc, subject: str, body=b"") -> dict:
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    msg = await nc.request(subject, body, timeout=T)
    return json.loads(msg.data)


def seqs(pair) -> tuple[int, int]:
    """(consumer_seq, stream_seq) of a nats-py SequenceInfo."""
    return (pair.consumer_seq, pair.stream_seq)


async def wait_for(predicate, timeout: float = T, interval: float = 0.02):
    """Poll an async predicate until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {value!r})")
        await asyncio.sleep(interval)


# ---------------------------------------------------------------------------
# pull
# ---------------------------------------------------------------------------


async def test_pull_subscribe_fetch_ack(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    for i in range(5):
        await js.publish(f"ev.{i % 2}", f"e{i}".encode())

    psub = await js.pull_subscribe("ev.>", durable="pd")
    [m] = await psub.fetch(1, timeout=2)
    assert (m.subject, m.data) == ("ev.0", b"e0")
    meta = m.metadata
    assert (meta.stream, meta.consumer) == ("EV", "pd")
    assert (meta.sequence.stream, meta.sequence.consumer) == (1, 1)
    assert (meta.num_delivered, meta.num_pending) == (1, 4)
    assert m.reply.startswith("$JS.ACK.EV.pd.1.1.1.")
    assert len(m.reply.split(".")) == 9
    await m.ack()

    msgs = await psub.fetch(3, timeout=2)
    assert [x.data for x in msgs] == [b"e1", b"e2", b"e3"]
    assert [x.metadata.num_pending for x in msgs] == [3, 2, 1]
    for x in msgs:
        await x.ack_sync()

    msgs = await psub.fetch(5, timeout=2)  # only one left: returned at once
    assert [x.data for x in msgs] == [b"e4"]
    await msgs[0].ack_sync()

    start = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await psub.fetch(1, timeout=0.5)  # 408 after the expiry
    assert time.monotonic() - start < 3

    info = await js.consumer_info("EV", "pd")
    assert seqs(info.delivered) == (5, 5)
    assert seqs(info.ack_floor) == (5, 5)
    assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)


async def test_fetch_with_heartbeat_and_batch(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    for i in range(3):
        await js.publish("ev.x", f"e{i}".encode())
    psub = await js.pull_subscribe("ev.>", durable="hb")
    msgs = await psub.fetch(2, timeout=2.5, heartbeat=1)
    assert [x.data for x in msgs] == [b"e0", b"e1"]
    for x in msgs:
        await x.ack()
    msgs = await psub.fetch(10, timeout=1)
    assert [x.data for x in msgs] == [b"e2"]


# ---------------------------------------------------------------------------
# walkthrough 1: durable resume
# ---------------------------------------------------------------------------

WORKER = r"""
import asyncio, sys, nats

async def main(url, fetch, ack):
    nc = await nats.connect(url, allow_reconnect=False)
    js = nc.jetstream(timeout=5)
    psub = await js.pull_subscribe_bind("order-worker", stream="ORDERS")
    msgs = await psub.fetch(fetch, timeout=5)
    for m in msgs:
        print("MSG", m.metadata.sequence.stream, m.metadata.num_delivered, m.data.decode(), flush=True)
    for m in msgs[:ack]:
        await m.ack_sync()
        print("ACK", m.metadata.sequence.stream, flush=True)
    print("DONE", flush=True)
    await asyncio.sleep(60)  # until killed

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


async def run_worker_until_done(url: str, fetch: int, ack: int):
    """Start the worker as its own OS process; return (process, report lines)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER, url, str(fetch), str(ack),
        stdout=asyncio.subprocess.PIPE,
    )
    lines = []
    try:
        while True:
            raw = await asyncio.wait_for(proc.stdout.readline(), 15)
            assert raw, f"worker exited early: {lines}"
            line = raw.decode().strip()
            if line == "DONE":
                return proc, lines
            lines.append(line)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def kill_process(proc):
    proc.send_signal(signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), T)


async def orders_setup(js, ack_wait=None):
    await js.add_stream(
        name="ORDERS", subjects=["orders.>"], retention=api.RetentionPolicy.LIMITS,
        max_age=24 * 3600, storage=api.StorageType.FILE,
    )
    await js.add_consumer("ORDERS", api.ConsumerConfig(
        durable_name="order-worker", ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL, ack_wait=ack_wait,
    ))
    for i in (1, 2, 3):
        ack = await js.publish("orders.new", json.dumps({"id": i}, separators=(",", ":")).encode())
        assert ack.seq == i


async def test_durable_resume_after_worker_killed(server, connect):
    """Walkthrough 1: the worker takes all three, acks two and is SIGKILLed."""
    nc, js = await js_ctx(connect)
    await orders_setup(js, ack_wait=2)

    proc, report = await run_worker_until_done(server.url, 3, 2)
    await kill_process(proc)
    assert report == [
        'MSG 1 1 {"id":1}', 'MSG 2 1 {"id":2}', 'MSG 3 1 {"id":3}', "ACK 1", "ACK 2",
    ]

    info = await js.consumer_info("ORDERS", "order-worker")
    assert info.ack_floor.stream_seq == 2
    assert (info.num_ack_pending, info.num_pending) == (1, 0)  # third: delivered, unacked
    assert info.delivered.stream_seq == 3

    # A restarted worker (new connection) gets only the third, after ack_wait.
    nc2 = await connect()
    js2 = nc2.jetstream(timeout=T)
    psub = await js2.pull_subscribe_bind("order-worker", stream="ORDERS")
    [m] = await psub.fetch(1, timeout=4)
    assert m.data == b'{"id":3}'
    assert (m.metadata.sequence.stream, m.metadata.num_delivered) == (3, 2)
    await m.ack_sync()
    with pytest.raises(nats.errors.TimeoutError):
        await psub.fetch(1, timeout=0.5)
    info = await js.consumer_info("ORDERS", "order-worker")
    assert info.ack_floor.stream_seq == 3
    assert (info.num_ack_pending, info.num_pending, info.num_redelivered) == (0, 0, 0)


async def test_durable_resume_after_server_restart(server, connect):
    """Walkthrough 1 with the server SIGKILLed: the worker only took two."""
    nc, js = await js_ctx(connect)
    await orders_setup(js)

    proc, report = await run_worker_until_done(server.url, 2, 2)
    assert report == ['MSG 1 1 {"id":1}', 'MSG 2 1 {"id":2}', "ACK 1", "ACK 2"]
    await nc.close()
    await asyncio.sleep(PERSIST_SETTLE)
    server.kill()
    await kill_process(proc)
    server.restart()

    nc, js = await js_ctx(connect)
    info = await js.consumer_info("ORDERS", "order-worker")
    assert info.ack_floor.stream_seq == 2
    assert (info.num_ack_pending, info.num_pending) == (0, 1)  # third: never delivered
    psub = await js.pull_subscribe_bind("order-worker", stream="ORDERS")
    [m] = await psub.fetch(1, timeout=2)
    assert m.data == b'{"id":3}'
    assert (m.metadata.sequence.stream, m.metadata.num_delivered) == (3, 1)
    await m.ack_sync()
    info = await js.consumer_info("ORDERS", "order-worker")
    assert (info.ack_floor.stream_seq, info.num_ack_pending, info.num_pending) == (3, 0, 0)


async def test_durable_resume_after_reconnect(server, connect):
    """A client that reconnects (server SIGKILLed and restarted underneath it)
    keeps its durable's position."""
    reconnected = asyncio.Event()

    async def on_reconnect():
        reconnected.set()

    nc = await connect(
        allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
        reconnected_cb=on_reconnect,
    )
    js = nc.jetstream(timeout=T)
    await orders_setup(js)
    psub = await js.pull_subscribe_bind("order-worker", stream="ORDERS")
    for m in await psub.fetch(2, timeout=2):
        await m.ack_sync()
    await asyncio.sleep(PERSIST_SETTLE)
    server.kill()
    server.restart()
    await asyncio.wait_for(reconnected.wait(), 10)
    msgs = await psub.fetch(5, timeout=2)
    assert [m.data for m in msgs] == [b'{"id":3}']
    await msgs[0].ack_sync()
    info = await js.consumer_info("ORDERS", "order-worker")
    assert info.ack_floor.stream_seq == 3


# ---------------------------------------------------------------------------
# push
# ---------------------------------------------------------------------------


async def test_push_subscribe(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    await js.publish("ev.a", b"one")
    await js.publish("ev.b", b"two", headers={"X-App": "y"})

    sub = await js.subscribe("ev.>", durable="push", manual_ack=True)
    m1 = await sub.next_msg(timeout=T)
    m2 = await sub.next_msg(timeout=T)
    assert (m1.subject, m1.data) == ("ev.a", b"one")
    assert (m2.subject, m2.data, m2.headers["X-App"]) == ("ev.b", b"two", "y")
    assert m2.metadata.sequence.stream == 2
    await m1.ack()
    await m2.ack_sync()
    await js.publish("ev.a", b"three")
    m3 = await sub.next_msg(timeout=T)
    assert m3.data == b"three"
    await m3.ack_sync()

    info = await js.consumer_info("EV", "push")
    assert info.config.deliver_subject
    assert info.push_bound is True
    await wait_for(lambda: _acked(js, "EV", "push", 3))

    # A callback subscription receives the same stream from the start.
    got = []
    done = asyncio.Event()

    async def cb(msg):
        got.append(msg.data)
        await msg.ack()
        if len(got) == 3:
            done.set()

    await js.subscribe("ev.>", durable="push2", cb=cb, manual_ack=True)
    await asyncio.wait_for(done.wait(), T)
    assert got == [b"one", b"two", b"three"]


async def _acked(js, stream, consumer, seq):
    info = await js.consumer_info(stream, consumer)
    return info.ack_floor.stream_seq == seq and info.num_ack_pending == 0


async def test_push_queue_subscribe(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    got = []

    async def cb(msg):
        got.append(msg.metadata.sequence.stream)
        await msg.ack()

    await js.subscribe("ev.>", queue="workers", durable="workers", cb=cb)
    await js.subscribe("ev.>", queue="workers", durable="workers", cb=cb)
    info = await js.consumer_info("EV", "workers")
    assert info.config.deliver_group == "workers"
    for i in range(20):
        await js.publish("ev.x", str(i).encode())
    await wait_for(lambda: _count(got, 20))
    assert sorted(got) == list(range(1, 21))


async def _count(items, n):
    return len(items) >= n


# ---------------------------------------------------------------------------
# nak / term / in_progress
# ---------------------------------------------------------------------------


async def test_nak_term_in_progress(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    await js.add_consumer("EV", api.ConsumerConfig(durable_name="w", ack_wait=1))
    psub = await js.pull_subscribe_bind("w", stream="EV")

    # nak: redelivered at once with delivery count 2.
    await js.publish("ev.a", b"nak-me")
    [m] = await psub.fetch(1, timeout=2)
    await m.nak()
    [again] = await psub.fetch(1, timeout=2)
    assert again.data == b"nak-me"
    assert (again.metadata.num_delivered, again.metadata.sequence.stream) == (2, 1)
    assert again.metadata.sequence.consumer == 2
    await again.ack_sync()

    # nak with delay: not before the delay.
    await js.publish("ev.a", b"later")
    [m] = await psub.fetch(1, timeout=2)
    start = time.monotonic()
    await m.nak(delay=0.8)
    [again] = await psub.fetch(1, timeout=3)
    assert 0.6 <= time.monotonic() - start < 2.5
    assert (again.data, again.metadata.num_delivered) == (b"later", 2)
    await again.ack_sync()

    # in_progress restarts ack_wait (1 s).
    await js.publish("ev.a", b"slow")
    [m] = await psub.fetch(1, timeout=2)
    await asyncio.sleep(0.6)
    await m.in_progress()
    wpi = time.monotonic()
    [again] = await psub.fetch(1, timeout=3)
    assert 0.8 <= time.monotonic() - wpi < 2.5
    assert again.metadata.num_delivered == 2
    await again.ack_sync()

    # term: never redelivered.
    await js.publish("ev.a", b"poison")
    [m] = await psub.fetch(1, timeout=2)
    await m.term()
    with pytest.raises(nats.errors.TimeoutError):
        await psub.fetch(1, timeout=1.6)
    info = await js.consumer_info("EV", "w")
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
    assert info.ack_floor.stream_seq == 4


async def test_ack_wait_redelivery_and_max_deliver(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    await js.add_consumer("EV", api.ConsumerConfig(durable_name="md", ack_wait=1, max_deliver=2))
    psub = await js.pull_subscribe_bind("md", stream="EV")
    await js.publish("ev.a", b"x")
    [m] = await psub.fetch(1, timeout=2)
    assert m.metadata.num_delivered == 1
    [m] = await psub.fetch(1, timeout=3)
    assert m.metadata.num_delivered == 2
    with pytest.raises(nats.errors.TimeoutError):
        await psub.fetch(1, timeout=1.6)
    info = await js.consumer_info("EV", "md")
    assert (info.num_ack_pending, info.num_redelivered) == (0, 1)


# ---------------------------------------------------------------------------
# consumer info / management
# ---------------------------------------------------------------------------


async def test_consumer_info_fields(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    for i in range(5):
        await js.publish("ev.a", f"e{i}".encode())
    ci = await js.add_consumer("EV", api.ConsumerConfig(
        durable_name="c", ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=100,
        description="for info",
    ))
    assert (ci.stream_name, ci.name) == ("EV", "c")
    assert ci.config.durable_name == "c"
    assert ci.config.ack_wait == 30  # nats-py reports seconds
    assert ci.config.max_deliver == -1
    assert ci.config.max_waiting == 512
    assert ci.config.max_ack_pending == 100
    assert ci.config.description == "for info"
    assert (ci.num_pending, ci.num_ack_pending, ci.num_waiting) == (5, 0, 0)

    psub = await js.pull_subscribe_bind("c", stream="EV")
    msgs = await psub.fetch(3, timeout=2)
    await msgs[0].ack_sync()
    await msgs[1].nak()
    info = await wait_for(lambda: _redelivery_ready(js))
    assert seqs(info.delivered) == (3, 3)
    assert seqs(info.ack_floor) == (1, 1)
    assert (info.num_ack_pending, info.num_pending) == (2, 2)

    [again] = await psub.fetch(1, timeout=2)
    assert again.metadata.num_delivered == 2
    info = await js.consumer_info("EV", "c")
    assert seqs(info.delivered) == (4, 3)
    assert info.num_redelivered == 1

    names = sorted(c.name for c in await js.consumers_info("EV"))
    assert names == ["c"]
    await js.add_consumer("EV", api.ConsumerConfig(durable_name="d"))
    assert sorted(c.name for c in await js.consumers_info("EV")) == ["c", "d"]
    assert await js.delete_consumer("EV", "d") is True
    with pytest.raises(nats.js.errors.NotFoundError) as exc:
        await js.consumer_info("EV", "d")
    assert exc.value.err_code == 10014
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.delete_consumer("EV", "d")

    # ack policy cannot change
    with pytest.raises(nats.js.errors.APIError) as exc:
        await js.add_consumer("EV", api.ConsumerConfig(durable_name="c", ack_policy=api.AckPolicy.NONE))
    assert exc.value.err_code == 10012


async def _redelivery_ready(js):
    info = await js.consumer_info("EV", "c")
    return info if info.ack_floor.stream_seq == 1 else None


async def test_consumer_create_forms_raw(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV.named", {
        "stream_name": "EV", "config": {"name": "named", "durable_name": "named", "ack_policy": "explicit"}})
    assert r["name"] == "named" and "error" not in r
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV.filt.ev.b", {
        "stream_name": "EV", "config": {"name": "filt", "ack_policy": "explicit", "filter_subject": "ev.b"}})
    assert r["config"]["filter_subject"] == "ev.b"
    r = await js_request(nc, "$JS.API.CONSUMER.DURABLE.CREATE.EV.legacy", {
        "stream_name": "EV", "config": {"durable_name": "legacy", "ack_policy": "explicit"}})
    assert r["name"] == "legacy"
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV", {
        "stream_name": "EV", "config": {"ack_policy": "explicit"}})
    assert len(r["name"]) > 0 and "name" not in r["config"]
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV.named", {
        "stream_name": "EV", "config": {"name": "named", "durable_name": "named", "ack_policy": "explicit",
                                        "description": "x"}, "action": "create"})
    assert r["error"]["err_code"] == 10148
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV.ghost", {
        "stream_name": "EV", "config": {"name": "ghost", "ack_policy": "explicit"}, "action": "update"})
    assert r["error"]["err_code"] == 10149
    r = await js_request(nc, "$JS.API.CONSUMER.CREATE.EV", {
        "stream_name": "EV", "config": {"name": "a.b", "ack_policy": "explicit"}})
    assert (r["error"]["code"], r["error"]["err_code"]) == (500, 10052)
    r = await js_request(nc, "$JS.API.CONSUMER.NAMES.EV")
    assert r["total"] == 4


# ---------------------------------------------------------------------------
# ordered consumer
# ---------------------------------------------------------------------------


async def test_ordered_consumer_reads_100_in_order(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="EV", subjects=["ev.>"])
    for i in range(1, 101):
        await nc.publish(f"ev.{i % 3}", f"m{i}".encode())
    await js.publish("ev.end", b"end")
    sub = await js.subscribe("ev.*", ordered_consumer=True)
    for i in range(1, 101):
        m = await sub.next_msg(timeout=T)
        assert m.data == f"m{i}".encode()
        assert m.metadata.sequence.stream == i
    info = await sub.consumer_info()
    assert info.config.ack_policy == api.AckPolicy.NONE
    assert info.config.flow_control is True


# ---------------------------------------------------------------------------
# KV
# ---------------------------------------------------------------------------


async def test_kv_watch(connect):
    nc, js = await js_ctx(connect)
    kv = await js.create_key_value(bucket="cfg", history=5)
    await kv.put("a.one", b"1")
    await kv.put("a.two", b"2")
    await kv.put("b.x", b"x")

    w = await kv.watch("a.*")
    e = await w.updates(timeout=T)
    assert (e.key, e.value, e.revision) == ("a.one", b"1", 1)
    e = await w.updates(timeout=T)
    assert (e.key, e.value, e.revision) == ("a.two", b"2", 2)
    assert await w.updates(timeout=T) is None  # end of the initial values

    await kv.put("b.x", b"ignored")
    await kv.put("a.one", b"11")
    e = await w.updates(timeout=T)
    assert (e.key, e.value, e.revision) == ("a.one", b"11", 5)
    await kv.delete("a.two")
    e = await w.updates(timeout=T)
    assert (e.key, e.operation) == ("a.two", "DEL")
    await w.stop()

    empty = await kv.watch("zzz")
    assert await empty.updates(timeout=T) is None
    await empty.stop()


async def test_kv_history(connect):
    nc, js = await js_ctx(connect)
    kv = await js.create_key_value(bucket="cfg", history=5)
    for v in (b"v1", b"v2", b"v3"):
        await kv.put("k", v)
    await kv.put("other", b"o")
    await kv.delete("k")
    hist = await kv.history("k")
    assert [(e.value, e.revision, e.operation) for e in hist] == [
        (b"v1", 1, None), (b"v2", 2, None), (b"v3", 3, None), (b"", 5, "DEL"),
    ]


async def test_kv_keys(connect):
    nc, js = await js_ctx(connect)
    kv = await js.create_key_value(bucket="cfg", history=5)
    await kv.put("app.color", b"blue")
    await kv.put("app.size", b"L")
    await kv.put("app.color", b"red")
    await kv.put("gone", b"x")
    await kv.delete("gone")
    assert sorted(await kv.keys()) == ["app.color", "app.size"]
    assert (await kv.get("app.color")).value == b"red"
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("gone")

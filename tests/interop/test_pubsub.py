"""Core pub/sub behaviour as seen by nats-py 2.16.0 (plus raw checks where the
client library would hide the server's behaviour)."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from natsutil import drain_until, pending, sync
from raw import CRLF

T = 5.0  # generous per-operation timeout; no test sleeps for it


async def test_pub_sub_basic(connect):
    nc = await connect()
    sub = await nc.subscribe("greet.joe")
    await sync(nc)
    for i in range(20):
        await nc.publish("greet.joe", b"hello %d" % i)
    await nc.publish("greet.joe", b"")  # zero-length payload
    msgs = [await sub.next_msg(timeout=T) for _ in range(21)]
    assert [m.data for m in msgs] == [b"hello %d" % i for i in range(20)] + [b""]
    assert all(m.subject == "greet.joe" for m in msgs)
    assert all(not m.reply for m in msgs)


async def test_pub_sub_across_connections(connect):
    sub_nc = await connect()
    pub_nc = await connect()
    sub = await sub_nc.subscribe("x.y")
    await sync(sub_nc)
    await pub_nc.publish("x.y", b"data", reply="my.reply")
    msg = await sub.next_msg(timeout=T)
    assert (msg.subject, msg.reply, msg.data) == ("x.y", "my.reply", b"data")


async def test_wildcard_star_and_gt(connect):
    nc = await connect()
    pub = await connect()
    star = await nc.subscribe("foo.*")
    gt = await nc.subscribe("foo.>")
    lead = await nc.subscribe("*.a")
    full = await nc.subscribe(">")
    await sync(nc)
    for subj in ["foo", "foo.a", "foo.a.b", "bar.a", "bar.a.b", "foobar.a", "foo.b.c.d"]:
        await pub.publish(subj, subj.encode())
    # every sub matches one of these sentinels; deliveries on a subscription keep publish order
    await pub.publish("foo.end", b"END")
    await pub.publish("end.a", b"END")

    assert [m.subject for m in await drain_until(star, b"END")] == ["foo.a"]
    assert [m.subject for m in await drain_until(gt, b"END")] == ["foo.a", "foo.a.b", "foo.b.c.d"]
    assert [m.subject for m in await drain_until(lead, b"END")] == ["foo.a", "bar.a", "foobar.a"]
    # (the `>` sub also saw sync()'s private _INBOX round trip; ignore that)
    got = [m.subject for m in await drain_until(full, b"END") if not m.subject.startswith("_INBOX.")]
    assert got == ["foo", "foo.a", "foo.a.b", "bar.a", "bar.a.b", "foobar.a", "foo.b.c.d"]
    # the `>` sub must also get the second sentinel, and nothing else
    assert (await full.next_msg(timeout=T)).subject == "end.a"


async def test_wildcard_does_not_match_parent_or_deeper(connect):
    """`foo.*` must not match `foo.a.b`; `foo.>` must not match `foo` (but does match `foo.a.b`)."""
    nc = await connect()
    star = await nc.subscribe("foo.*")
    gt = await nc.subscribe("foo.>")
    await sync(nc)
    await nc.publish("foo.a.b", b"deep")
    await nc.publish("foo", b"parent")
    await nc.publish("foo.z", b"END")
    assert [m.data for m in await drain_until(star, b"END")] == []
    assert [m.data for m in await drain_until(gt, b"END")] == [b"deep"]


async def test_msg_carries_published_subject_not_pattern(connect):
    nc = await connect()
    sub = await nc.subscribe("orders.*.created")
    await sync(nc)
    await nc.publish("orders.42.created", b"x")
    msg = await sub.next_msg(timeout=T)
    assert msg.subject == "orders.42.created"


async def test_queue_group_exactly_once(connect):
    n_msgs = 300
    members = [await connect(), await connect()]
    plain_nc = await connect()
    pub = await connect()
    qsubs = [await nc.subscribe("work.items", queue="workers") for nc in members]
    plain = await plain_nc.subscribe("work.items")
    for nc in members + [plain_nc]:
        await sync(nc)

    for i in range(n_msgs):
        await pub.publish("work.items", b"%d" % i)
    await sync(pub)  # server has routed every message once this returns
    for nc in members + [plain_nc]:
        await sync(nc)  # ... and each client has read its deliveries

    per_member = [[int(m.data) for m in await pending(s)] for s in qsubs]
    everything = sorted(per_member[0] + per_member[1])
    assert everything == list(range(n_msgs)), "each message must reach exactly one queue member"
    assert len(per_member[0]) > 0 and len(per_member[1]) > 0, (
        f"both members should get some of {n_msgs} messages: {[len(p) for p in per_member]}")
    # a non-queue subscriber on the same subject still sees all of them
    assert [int(m.data) for m in await pending(plain)] == list(range(n_msgs))


async def test_queue_groups_are_independent(connect):
    nc = await connect()
    a = await nc.subscribe("jobs", queue="A")
    b = await nc.subscribe("jobs", queue="B")
    await sync(nc)
    for i in range(10):
        await nc.publish("jobs", b"%d" % i)
    await sync(nc)
    assert len(await pending(a)) == 10
    assert len(await pending(b)) == 10


async def test_request_reply(connect):
    responder = await connect()
    requester = await connect()

    async def echo(msg):
        await msg.respond(b"echo:" + msg.data)

    await responder.subscribe("svc.echo", cb=echo)
    await sync(responder)
    reply = await requester.request("svc.echo", b"hi", timeout=T)
    assert reply.data == b"echo:hi"

    # many concurrent requests, each reply goes to the right requester
    replies = await asyncio.gather(*[requester.request("svc.echo", b"%d" % i, timeout=T) for i in range(50)])
    assert [r.data for r in replies] == [b"echo:%d" % i for i in range(50)]


async def test_request_reply_queue_responders(connect):
    resp1, resp2 = await connect(), await connect()
    requester = await connect()

    async def make_cb(tag):
        async def cb(msg):
            await msg.respond(tag + msg.data)
        return cb

    await resp1.subscribe("svc.q", queue="q", cb=await make_cb(b"1:"))
    await resp2.subscribe("svc.q", queue="q", cb=await make_cb(b"2:"))
    await sync(resp1)
    await sync(resp2)
    replies = [await requester.request("svc.q", b"x", timeout=T) for _ in range(20)]
    assert all(r.data in (b"1:x", b"2:x") for r in replies)


async def test_headers_round_trip(connect):
    nc = await connect()
    pub = await connect()
    sub = await nc.subscribe("hdr.test")
    await sync(nc)
    headers = {
        "X-Trace-Id": "abc-123",
        "lower-case-key": "kept as sent",
        "MiXeD-CaSe": "Value With Spaces",
        "X-List": "a, b, c",  # a multi-valued header as nats-py can express it (one key)
        "X-Empty-Body": "1",
    }
    await pub.publish("hdr.test", b"payload", headers=headers)
    await pub.publish("hdr.test", b"", headers={"Only": "headers"})
    msg = await sub.next_msg(timeout=T)
    assert msg.data == b"payload"
    assert msg.headers == headers  # names keep their case
    msg2 = await sub.next_msg(timeout=T)
    assert msg2.data == b"" and msg2.headers == {"Only": "headers"}


async def test_headers_wire_bytes_from_natspy(connect, raw):
    """nats-py's header block must reach a raw subscriber byte-for-byte (case kept)."""
    sub = await raw()
    await sub.send(b"SUB hdr.wire 7\r\n")
    await sub.flush()
    pub = await connect()
    await pub.publish("hdr.wire", b"body", headers={"X-Mixed-Case": "V1", "lower": "v2"})
    op = await sub.read_op()
    block = b"NATS/1.0\r\nX-Mixed-Case: V1\r\nlower: v2\r\n\r\n"
    assert op.raw == b"HMSG hdr.wire 7 %d %d\r\n" % (len(block), len(block) + 4) + block + b"body\r\n"


async def test_multi_value_headers_to_natspy(connect, raw):
    """Duplicate header keys are forwarded as sent; nats-py (dict headers) still parses the message.

    (nats-py's dict cannot carry two values for one key; the byte-exact multi-value
    check is in test_protocol.py::test_hpub_hmsg_framing.)"""
    nc = await connect()
    sub = await nc.subscribe("hdr.multi")
    await sync(nc)
    pub = await raw()
    block = b"NATS/1.0\r\nX-One: 1\r\nX-Multi: a\r\nX-Multi: b\r\n\r\n"
    await pub.send(b"HPUB hdr.multi %d %d\r\n" % (len(block), len(block) + 4) + block + b"body\r\n")
    msg = await sub.next_msg(timeout=T)
    assert msg.data == b"body"
    assert msg.headers["X-One"] == "1"
    assert msg.headers["X-Multi"] in ("a", "b")


async def test_no_responders(connect):
    nc = await connect()
    t0 = time.monotonic()
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request("nobody.listens.here", b"hello", timeout=T)
    assert time.monotonic() - t0 < 1.5, "no-responders must be immediate, not a request timeout"


async def test_no_responders_after_responder_leaves(connect):
    nc = await connect()
    resp = await connect()

    async def cb(msg):
        await msg.respond(b"ok")

    sub = await resp.subscribe("svc.gone", cb=cb)
    await sync(resp)
    assert (await nc.request("svc.gone", b"", timeout=T)).data == b"ok"
    await sub.unsubscribe()
    await sync(resp)
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request("svc.gone", b"", timeout=T)


async def test_unsubscribe_after_n(connect):
    nc = await connect()
    pub = await connect()
    sub = await nc.subscribe("limited")
    await sub.unsubscribe(limit=3)
    await sync(nc)
    for i in range(10):
        await pub.publish("limited", b"%d" % i)
    await sync(pub)
    await sync(nc)
    got = [await sub.next_msg(timeout=T) for _ in range(3)]
    assert [m.data for m in got] == [b"0", b"1", b"2"]
    assert sub.pending_msgs == 0  # everything delivered is already buffered (sync above)


async def test_subscribe_max_msgs(connect):
    nc = await connect()
    sub = await nc.subscribe("limited2", max_msgs=5)
    await sync(nc)
    for i in range(8):
        await nc.publish("limited2", b"%d" % i)
    await sync(nc)
    got = [await sub.next_msg(timeout=T) for _ in range(5)]
    assert [m.data for m in got] == [b"%d" % i for i in range(5)]
    assert sub.delivered == 5


async def test_server_side_auto_unsubscribe(connect, raw):
    """`UNSUB <sid> <max>` is enforced by the server (nats-py also filters client-side,
    so check the wire with a raw subscriber)."""
    sub = await raw()
    await sub.send(b"SUB auto.x 1\r\nUNSUB 1 3\r\n")
    await sub.flush()
    pub = await connect()
    for i in range(10):
        await pub.publish("auto.x", b"%d" % i)
    await sync(pub)  # all ten routed
    ops = await sub.flush()  # deliveries queued before this PONG
    assert [(o.name, o.payload) for o in ops] == [("MSG", b"0"), ("MSG", b"1"), ("MSG", b"2")]


async def test_unsub_max_counts_already_delivered(connect, raw):
    """max counts messages already delivered on that sid (reference: `UNSUB 2 2` after one delivery
    lets exactly one more through)."""
    sub = await raw()
    await sub.send(b"SUB cnt.x 2\r\n")
    await sub.flush()
    await sub.send(b"PUB cnt.x 1\r\na\r\n")
    assert [o.payload for o in await sub.flush()] == [b"a"]
    await sub.send(b"UNSUB 2 2\r\nPUB cnt.x 1\r\nb\r\nPUB cnt.x 1\r\nc\r\nPUB cnt.x 1\r\nd\r\n")
    assert [o.payload for o in await sub.flush()] == [b"b"]


async def test_no_echo(connect):
    quiet = await connect(no_echo=True)
    other = await connect()
    watcher = await other.subscribe("echo.test")
    await sync(other)
    own = await quiet.subscribe("echo.test")
    await quiet.publish("echo.test", b"from-quiet")  # after its own SUB on the same connection
    # once the watcher has it, the server has processed quiet's SUB and PUB
    assert (await watcher.next_msg(timeout=T)).data == b"from-quiet"
    await other.publish("echo.test", b"END")
    assert await drain_until(own, b"END") == [], "no_echo client received its own publish"
    assert (await watcher.next_msg(timeout=T)).data == b"END"


async def test_echo_default_delivers_own(connect):
    nc = await connect()
    sub = await nc.subscribe("echo.on")
    await sync(nc)
    await nc.publish("echo.on", b"mine")
    assert (await sub.next_msg(timeout=T)).data == b"mine"


@pytest.mark.server_config(max_payload=1024)
async def test_max_payload_natspy(connect):
    nc = await connect()
    assert nc.max_payload == 1024
    sub = await nc.subscribe("big")
    await sync(nc)
    await nc.publish("big", b"x" * 1024)
    assert (await sub.next_msg(timeout=T)).data == b"x" * 1024
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish("big", b"x" * 1025)
    await nc.flush()  # still connected
    assert nc.is_connected


@pytest.mark.server_config(max_payload=1024)
async def test_max_payload_raw_exact_ok_one_over_fails(raw):
    c = await raw()
    assert c.info["max_payload"] == 1024
    await c.send(b"SUB big 1\r\n")
    await c.send(b"PUB big 1024\r\n" + b"y" * 1024 + CRLF)
    ops = await c.flush()
    assert [(o.name, len(o.payload)) for o in ops] == [("MSG", 1024)]
    await c.send(b"PUB big 1025\r\n")
    op = await c.read_op()
    assert op.raw == b"-ERR 'Maximum Payload Violation'\r\n"
    await c.read_to_eof()


@pytest.mark.server_config(max_payload=1024)
async def test_max_payload_hpub_counts_headers(raw):
    """The limit applies to the HPUB total (headers + payload)."""
    c = await raw()
    await c.send(b"SUB big 1\r\n")
    block = b"NATS/1.0\r\nA: b\r\n\r\n"
    body = b"z" * (1024 - len(block))
    await c.send(b"HPUB big %d 1024\r\n" % len(block) + block + body + CRLF)
    ops = await c.flush()
    assert [(o.name, o.payload) for o in ops] == [("HMSG", block + body)]
    await c.send(b"HPUB big %d 1025\r\n" % len(block))
    op = await c.read_op()
    assert op.raw == b"-ERR 'Maximum Payload Violation'\r\n"
    await c.read_to_eof()

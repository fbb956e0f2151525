"""JetStream streams as nats-py 2.16.0 drives them: stream create/info/update/delete,
publish acks and dedup, Nats-Expected-* errors, limits, purge variants, get_msg,
direct get, message delete, deny_delete/deny_purge and a SIGKILL restart.

Expectations are the reference nats-server's (KEEL_TEST_SERVER=nats runs the
same tests against it); error checks use the `err_code` nats-py
exposes on its JetStream APIError subclasses.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats.js.errors
import pytest
from nats.js import api

pytestmark = pytest.mark.jetstream

T = 5.0


async def js_request(nc, subject: str, body=b"") -> dict:
    """Raw JetStream API request; returns the parsed JSON reply."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    msg = await nc.request(subject, body, timeout=T)
    return json.loads(msg.data)


async def js_ctx(connect):
    nc = await connect()
    return nc, nc.jetstream(timeout=T)


async def test_account_info_counts(connect):
    nc, js = await js_ctx(connect)
    info = await js.account_info()
    assert (info.streams, info.consumers, info.memory, info.storage) == (0, 0, 0, 0)
    raw = await js_request(nc, "$JS.API.INFO")
    assert raw["type"] == "io.nats.jetstream.api.v1.account_info_response"
    assert raw["limits"]["max_streams"] == -1
    assert raw["limits"]["max_memory"] == -1

    await js.add_stream(name="A", subjects=["a"])
    await js.add_stream(name="B", subjects=["b"], storage=api.StorageType.MEMORY)
    await js.publish("a", b"hello")  # file: 30 + 1 + 5
    await js.publish("b", b"hello")  # memory: 16 + 1 + 5
    info = await js.account_info()
    assert info.streams == 2
    assert info.storage == 36
    assert info.memory == 22

    await js.delete_stream("A")
    assert (await js.account_info()).streams == 1


async def test_stream_create_info_update_delete(connect):
    nc, js = await js_ctx(connect)
    si = await js.add_stream(name="ORDERS", subjects=["orders.>"])
    cfg = si.config
    assert cfg.name == "ORDERS"
    assert cfg.subjects == ["orders.>"]
    assert cfg.retention == api.RetentionPolicy.LIMITS
    assert cfg.storage == api.StorageType.FILE
    assert cfg.discard == api.DiscardPolicy.OLD
    assert cfg.max_msgs == -1 and cfg.max_bytes == -1 and cfg.max_msgs_per_subject == -1
    assert cfg.duplicate_window == 120.0  # nats-py sends 0 = server default (2 min)
    assert cfg.num_replicas == 1
    assert si.state.messages == 0 and si.state.first_seq == 0

    # identical create again is fine
    await js.add_stream(name="ORDERS", subjects=["orders.>"])

    # different config under the same name
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.add_stream(name="ORDERS", subjects=["orders.>"], max_msgs=5)
    assert exc.value.err_code == 10058
    # overlapping subjects
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.add_stream(name="NEW", subjects=["orders.new"])
    assert exc.value.err_code == 10065
    assert exc.value.description == "subjects overlap with an existing stream"

    for i in range(3):
        ack = await js.publish("orders.new", b"o%d" % i)
        assert (ack.stream, ack.seq) == ("ORDERS", i + 1)
    si = await js.stream_info("ORDERS")
    assert (si.state.messages, si.state.first_seq, si.state.last_seq) == (3, 1, 3)
    assert si.state.bytes == 3 * (30 + len("orders.new") + 2)

    # allowed update: more subjects, a max_msgs limit
    si = await js.update_stream(name="ORDERS", subjects=["orders.>", "returns.>"], max_msgs=2)
    assert si.config.subjects == ["orders.>", "returns.>"]
    assert si.config.max_msgs == 2
    ack = await js.publish("returns.x", b"r")
    assert ack.seq == 4
    si = await js.stream_info("ORDERS")
    assert (si.state.messages, si.state.first_seq) == (2, 3)

    # storage type can not change
    with pytest.raises(nats.js.errors.ServerError) as exc:
        await js.update_stream(
            name="ORDERS", subjects=["orders.>", "returns.>"], storage=api.StorageType.MEMORY
        )
    assert exc.value.err_code == 10052
    assert exc.value.description == "stream configuration update can not change storage type"

    assert await js.find_stream_name_by_subject("returns.y") == "ORDERS"

    assert await js.delete_stream("ORDERS") is True
    with pytest.raises(nats.js.errors.NotFoundError) as exc:
        await js.stream_info("ORDERS")
    assert exc.value.err_code == 10059
    with pytest.raises(nats.js.errors.NotFoundError) as exc:
        await js.delete_stream("ORDERS")
    assert exc.value.err_code == 10059

    names = await js_request(nc, "$JS.API.STREAM.NAMES", {"subject": "orders.x"})
    assert names["streams"] is None and names["total"] == 0


async def test_stream_info_subjects_and_deleted(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="S", subjects=["s.>"])
    for subj in ["s.a", "s.b", "s.a", "s.c"]:
        await js.publish(subj, b"x")
    si = await js.stream_info("S", subjects_filter=">")
    assert si.state.subjects == {"s.a": 2, "s.b": 1, "s.c": 1}
    raw = await js_request(nc, "$JS.API.STREAM.INFO.S")
    assert raw["state"]["num_subjects"] == 3
    assert "subjects" not in raw["state"]
    await js.delete_msg("S", 2)
    raw = await js_request(nc, "$JS.API.STREAM.INFO.S", {"deleted_details": True})
    assert raw["state"]["deleted"] == [2]
    assert raw["state"]["num_deleted"] == 1
    assert raw["state"]["messages"] == 3


async def test_publish_ack_and_dedup(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="P", subjects=["p.>"], duplicate_window=60)
    ack = await js.publish("p.a", b"one")
    assert (ack.stream, ack.seq, ack.duplicate) == ("P", 1, None)
    ack = await js.publish("p.a", b"dup", headers={"Nats-Msg-Id": "A1"})
    assert (ack.seq, ack.duplicate) == (2, None)
    ack = await js.publish("p.a", b"dup", headers={"Nats-Msg-Id": "A1"})
    assert (ack.seq, ack.duplicate) == (2, True)
    ack = await js.publish("p.a", b"three")
    assert ack.seq == 3
    assert (await js.stream_info("P")).state.messages == 3

    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish("nostream.x", b"x")


async def test_expected_headers(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="P", subjects=["p.>"])
    await js.publish("p.a", b"x")  # 1

    # Nats-Expected-Stream (nats-py's stream= argument)
    assert (await js.publish("p.b", b"x", stream="P")).seq == 2
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("p.b", b"x", stream="OTHER")
    assert (exc.value.err_code, exc.value.description) == (10060, "expected stream does not match")

    # Nats-Expected-Last-Sequence
    assert (await js.publish("p.b", b"x", headers={"Nats-Expected-Last-Sequence": "2"})).seq == 3
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("p.b", b"x", headers={"Nats-Expected-Last-Sequence": "1"})
    assert (exc.value.err_code, exc.value.description) == (10071, "wrong last sequence: 3")

    # Nats-Expected-Last-Msg-Id
    await js.publish("p.c", b"x", headers={"Nats-Msg-Id": "C1"})  # 4
    ack = await js.publish(
        "p.c", b"x", headers={"Nats-Expected-Last-Msg-Id": "C1", "Nats-Msg-Id": "C2"}
    )
    assert ack.seq == 5
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("p.c", b"x", headers={"Nats-Expected-Last-Msg-Id": "C1"})
    assert (exc.value.err_code, exc.value.description) == (10070, "wrong last msg ID: C2")

    # Nats-Expected-Last-Subject-Sequence
    hdr = {"Nats-Expected-Last-Subject-Sequence": "3"}
    assert (await js.publish("p.b", b"x", headers=hdr)).seq == 6
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("p.b", b"x", headers=hdr)
    assert (exc.value.err_code, exc.value.description) == (10071, "wrong last sequence: 6")
    zero = {"Nats-Expected-Last-Subject-Sequence": "0"}
    assert (await js.publish("p.new", b"x", headers=zero)).seq == 7
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("p.new", b"x", headers=zero)
    assert exc.value.err_code == 10071

    assert (await js.stream_info("P")).state.messages == 7


async def test_limits(connect):
    nc, js = await js_ctx(connect)

    # max_msgs, discard old: the newest stay
    await js.add_stream(name="MM", subjects=["mm"], max_msgs=3)
    for i in range(10):
        await js.publish("mm", b"m%d" % i)
    st = (await js.stream_info("MM")).state
    assert (st.messages, st.first_seq, st.last_seq) == (3, 8, 10)

    # discard new
    await js.add_stream(name="LIM", subjects=["lim"], max_msgs=1, discard=api.DiscardPolicy.NEW)
    await js.publish("lim", b"1")
    with pytest.raises(nats.js.errors.ServiceUnavailableError) as exc:
        await js.publish("lim", b"2")
    assert (exc.value.err_code, exc.value.description) == (10077, "maximum messages exceeded")

    # max_msgs_per_subject
    await js.add_stream(name="PER", subjects=["per.*"], max_msgs_per_subject=2)
    for subj in ["per.a"] * 4 + ["per.b"]:
        await js.publish(subj, b"x")
    si = await js.stream_info("PER", subjects_filter=">")
    assert si.state.subjects == {"per.a": 2, "per.b": 1}

    # max_msg_size (headers count)
    await js.add_stream(name="SZ", subjects=["sz"], max_msg_size=32)
    await js.publish("sz", b"x" * 32)
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.publish("sz", b"x" * 16, headers={"X-Pad": "123456"})
    assert (exc.value.err_code, exc.value.description) == (10054, "message size exceeds maximum allowed")

    # max_age: expired on a timer, no further writes needed
    await js.add_stream(name="AGE", subjects=["age"], max_age=1.0)
    for _ in range(3):
        await js.publish("age", b"x")
    deadline = time.monotonic() + 5
    while True:
        st = (await js.stream_info("AGE")).state
        if st.messages == 0:
            break
        assert time.monotonic() < deadline, f"max_age did not expire messages: {st}"
        await asyncio.sleep(0.05)
    assert (st.first_seq, st.last_seq, st.bytes) == (4, 3, 0)


async def test_rollup(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="R", subjects=["r.>"], allow_rollup_hdrs=True)
    for subj in ["r.a", "r.a", "r.b"]:
        await js.publish(subj, b"x")
    ack = await js.publish("r.a", b"roll", headers={"Nats-Rollup": "sub"})
    assert ack.seq == 4
    si = await js.stream_info("R", subjects_filter=">")
    assert si.state.subjects == {"r.a": 1, "r.b": 1}
    await js.publish("r.b", b"all", headers={"Nats-Rollup": "all"})
    st = (await js.stream_info("R")).state
    assert (st.messages, st.first_seq) == (1, 5)

    await js.add_stream(name="NR", subjects=["nr"])
    with pytest.raises(nats.js.errors.ServerError) as exc:
        await js.publish("nr", b"x", headers={"Nats-Rollup": "sub"})
    assert (exc.value.err_code, exc.value.description) == (10111, "rollup not permitted")


async def test_purge_variants(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="P", subjects=["p.*"])
    for subj in ["p.a"] * 3 + ["p.b"] * 3 + ["p.c"] * 2:
        await js.publish(subj, b"x")

    assert await js.purge_stream("P", subject="p.c") is True
    assert (await js.stream_info("P")).state.messages == 6
    await js.purge_stream("P", subject="p.a", keep=1)
    st = (await js.stream_info("P")).state
    assert (st.messages, st.first_seq) == (4, 3)
    resp = await js_request(nc, "$JS.API.STREAM.PURGE.P", {"keep": 2})
    assert resp == {"type": "io.nats.jetstream.api.v1.stream_purge_response", "success": True, "purged": 2}
    await js.purge_stream("P", seq=6)  # everything below 6
    st = (await js.stream_info("P")).state
    assert (st.messages, st.first_seq) == (1, 6)
    await js.purge_stream("P")
    st = (await js.stream_info("P")).state
    assert (st.messages, st.first_seq, st.last_seq) == (0, 9, 8)
    assert (await js.publish("p.a", b"x")).seq == 9

    resp = await js_request(nc, "$JS.API.STREAM.PURGE.NOPE", {})
    assert resp["error"]["err_code"] == 10059


async def test_get_msg_and_delete(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="G", subjects=["g.*"])
    await js.publish("g.a", b"a1", headers={"X-Tag": "t1"})
    await js.publish("g.b", b"b1")
    await js.publish("g.a", b"a2")

    msg = await js.get_msg("G", 1)
    assert (msg.subject, msg.seq, msg.data) == ("g.a", 1, b"a1")
    assert msg.headers["X-Tag"] == "t1"
    msg = await js.get_last_msg("G", "g.a")
    assert (msg.seq, msg.data) == (3, b"a2")
    msg = await js.get_msg("G", seq=2, subject="g.a", next=True)
    assert msg.seq == 3
    with pytest.raises(nats.js.errors.NotFoundError) as exc:
        await js.get_msg("G", 99)
    assert (exc.value.err_code, exc.value.description) == (10037, "no message found")

    assert await js.delete_msg("G", 2) is True
    with pytest.raises(nats.js.errors.BadRequestError) as exc:
        await js.delete_msg("G", 2)
    assert (exc.value.err_code, exc.value.description) == (10043, "sequence 2 not found")
    with pytest.raises(nats.js.errors.NotFoundError) as exc:
        await js.get_msg("G", 2)
    assert exc.value.err_code == 10037
    st = (await js.stream_info("G")).state
    assert (st.messages, st.num_deleted) == (2, 1)


async def test_direct_get(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="DG", subjects=["dg.*"], allow_direct=True)
    await js.publish("dg.a", b"v0", headers={"X-N": "0"})
    await js.publish("dg.a", b"v1")
    await js.publish("dg.b", b"b0")

    msg = await js.get_msg("DG", 1, direct=True)
    assert (msg.subject, msg.seq, msg.data) == ("dg.a", 1, b"v0")
    assert msg.headers["X-N"] == "0"
    msg = await js.get_last_msg("DG", "dg.a", direct=True)
    assert (msg.seq, msg.data) == (2, b"v1")
    msg = await js.get_msg("DG", seq=1, subject="dg.b", next=True, direct=True)
    assert msg.seq == 3

    # raw: the stored message plus Nats-* headers; 404 status when missing
    reply = await nc.request("$JS.API.DIRECT.GET.DG", b'{"seq": 1}', timeout=T)
    assert reply.data == b"v0"
    assert reply.headers["Nats-Stream"] == "DG"
    assert reply.headers["Nats-Subject"] == "dg.a"
    assert reply.headers["Nats-Sequence"] == "1"
    assert "Nats-Time-Stamp" in reply.headers
    reply = await nc.request("$JS.API.DIRECT.GET.DG", b'{"seq": 99}', timeout=T)
    assert reply.headers.get("Status") == "404"
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.get_msg("DG", 99, direct=True)


async def test_deny_delete_and_purge(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="DD", subjects=["dd"], deny_delete=True, deny_purge=True)
    await js.publish("dd", b"x")
    with pytest.raises(nats.js.errors.ServerError) as exc:
        await js.delete_msg("DD", 1)
    assert (exc.value.err_code, exc.value.description) == (10057, "message delete not permitted")
    with pytest.raises(nats.js.errors.ServerError) as exc:
        await js.purge_stream("DD")
    assert (exc.value.err_code, exc.value.description) == (10110, "stream purge not permitted")
    assert (await js.stream_info("DD")).state.messages == 1
    assert await js.delete_stream("DD") is True


async def test_file_stream_survives_sigkill(server, connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="DUR", subjects=["dur.*"])
    acks = await asyncio.gather(
        *[js.publish(f"dur.{i % 5}", b"payload %d" % i) for i in range(1, 201)]
    )
    assert sorted(a.seq for a in acks) == list(range(1, 201))
    before = await js_request(nc, "$JS.API.STREAM.INFO.DUR", {"subjects_filter": ">"})
    await nc.close()

    server.kill()
    server.restart()

    nc, js = await js_ctx(connect)
    after = await js_request(nc, "$JS.API.STREAM.INFO.DUR", {"subjects_filter": ">"})
    assert after["config"] == before["config"]
    for key in ("messages", "bytes", "first_seq", "last_seq", "num_subjects", "subjects"):
        assert after["state"][key] == before["state"][key], key
    # gather() keeps call order: acks[i - 1] is the ack of "payload i"
    published = {ack.seq: i for i, ack in enumerate(acks, start=1)}
    for seq, i in sorted(published.items()):
        msg = await js.get_msg("DUR", seq)
        assert (msg.seq, msg.subject, msg.data) == (seq, f"dur.{i % 5}", b"payload %d" % i)
    assert (await js.publish("dur.0", b"after")).seq == 201

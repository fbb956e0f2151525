"""Stream features as nats-py 2.16.0 configures them through its StreamConfig: republish,
subject transforms, sources and mirrors (with their stream info), first_seq and
`Nats-TTL: never` under max_age. Expectations are the reference nats-server's
(KEEL_TEST_SERVER=nats)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js import api

pytestmark = pytest.mark.jetstream

T = 5.0


async def js_ctx(connect):
    nc = await connect()
    return nc, nc.jetstream(timeout=T)


async def wait_info(js, name, pred, what):
    deadline = time.monotonic() + 20
    while True:
        si = await js.stream_info(name, subjects_filter=">")
        if pred(si):
            return si
        assert time.monotonic() < deadline, f"{name}: never {what}: {si}"
        await asyncio.sleep(0.05)


async def test_republish_and_headers_only(connect):
    nc, js = await js_ctx(connect)
    si = await js.add_stream(
        name="R",
        subjects=["r.>"],
        republish=api.RePublish(src="r.>", dest="rp.>"),
    )
    assert si.config.republish.src == "r.>" and si.config.republish.dest == "rp.>"
    await js.add_stream(
        name="H",
        subjects=["h.>"],
        republish=api.RePublish(src="h.>", dest="rph.>", headers_only=True),
    )
    sub = await nc.subscribe("rp.>")
    sub_h = await nc.subscribe("rph.>")
    await nc.flush()
    ack = await js.publish("r.a", b"one", headers={"X-Y": "z"})
    await js.publish("h.b", b"hello")
    m = await sub.next_msg(timeout=T)
    assert m.subject == "rp.a" and m.data == b"one"
    assert m.headers["X-Y"] == "z"
    assert m.headers["Nats-Stream"] == "R"
    assert m.headers["Nats-Subject"] == "r.a"
    assert m.headers["Nats-Sequence"] == str(ack.seq)
    assert m.headers["Nats-Last-Sequence"] == "0"
    h = await sub_h.next_msg(timeout=T)
    assert h.subject == "rph.b" and h.data == b""
    assert h.headers["Nats-Msg-Size"] == "5"


async def test_subject_transform(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(
        name="T",
        subjects=["t.*.*"],
        subject_transform=api.SubjectTransform(src="t.*.*", dest="x.{{wildcard(2)}}.$1"),
    )
    await js.publish("t.a.b", b"1")
    si = await js.stream_info("T", subjects_filter=">")
    assert si.state.subjects == {"x.b.a": 1}
    msg = await js.get_msg("T", 1)
    assert msg.subject == "x.b.a"


async def test_sources_and_mirror(connect):
    nc, js = await js_ctx(connect)
    await js.add_stream(name="O", subjects=["o.>"], allow_direct=True)
    await js.publish("o.a", b"1")
    await js.publish("o.b", b"2")
    await js.publish("o.a", b"3")
    await js.add_stream(
        name="S",
        subjects=["s.>"],
        sources=[
            api.StreamSource(name="O", filter_subject="o.a"),
            api.StreamSource(
                name="O", subject_transforms=[api.SubjectTransform(src="o.b", dest="s.b")]
            ),
        ],
    )
    si = await js.add_stream(name="M", mirror=api.StreamSource(name="O"))
    assert si.config.mirror.name == "O"
    assert si.config.mirror_direct is True
    si = await wait_info(js, "S", lambda s: s.state.messages == 3, "sourced 3")
    assert si.state.subjects == {"o.a": 2, "s.b": 1}
    assert [s.name for s in si.sources] == ["O", "O"]
    assert all(s.lag == 0 for s in si.sources)
    # The two sources run side by side: look messages up by subject.
    msg = await js.get_last_msg("S", "s.b")
    assert msg.headers["Nats-Stream-Source"].startswith("O 2 o.b s.b o.b ")
    si = await wait_info(js, "M", lambda s: s.state.last_seq == 3, "mirrored 3")
    assert si.mirror.name == "O" and si.mirror.lag == 0
    assert (await js.get_msg("M", 2)).data == b"2"
    # A new origin message reaches both.
    await js.publish("o.b", b"4")
    await wait_info(js, "S", lambda s: s.state.messages == 4, "sourced the 4th")
    await wait_info(js, "M", lambda s: s.state.last_seq == 4, "mirrored the 4th")


async def test_first_seq_and_ttl_never(connect):
    nc, js = await js_ctx(connect)
    si = await js.add_stream(name="F", subjects=["f"], first_seq=42)
    assert si.config.first_seq == 42
    assert (await js.publish("f", b"x")).seq == 42
    await js.add_stream(name="N", subjects=["n.>"], max_age=1.0, allow_msg_ttl=True)
    await js.publish("n.keep", b"k", headers={"Nats-TTL": "never"})
    await js.publish("n.go", b"g")
    si = await wait_info(js, "N", lambda s: s.state.messages == 1, "expired n.go")
    assert si.state.subjects == {"n.keep": 1}

"""Raw-socket protocol conformance: byte-level behaviour observed from nats-server 2.15.1
(each test also runs against it: KEEL_TEST_SERVER=nats)."""

from __future__ import annotations

import json
import re

import nats
import pytest

from natsutil import sync
from raw import CRLF, RawClient

T = 5.0


def assert_only_pings(data: bytes, what: str) -> None:
    """After an expected close the server may have sent nothing else (a keepalive PING is tolerated)."""
    rest = data.replace(b"PING\r\n", b"")
    assert rest == b"", f"{what}: unexpected bytes before close: {rest[:300]!r}"


async def expect_err_and_close(c: RawClient, text: str) -> None:
    op = await c.read_op(timeout=T)
    assert op.raw == b"-ERR '" + text.encode() + b"'\r\n", f"expected -ERR '{text}', got {op!r}"
    rest = await c.read_to_eof(timeout=T)
    assert_only_pings(rest, f"after -ERR '{text}'")


async def expect_err_stays_open(c: RawClient, text: str) -> None:
    op = await c.read_op(timeout=T)
    assert op.raw == b"-ERR '" + text.encode() + b"'\r\n", f"expected -ERR '{text}', got {op!r}"
    assert await c.flush() == [], "connection should stay usable after this -ERR"


# --------------------------------------------------------------------------- INFO / CONNECT


async def test_info_line_format(server):
    c = await RawClient.open(server.port)
    line = c.info_line
    assert line.startswith(b"INFO {")
    assert line.endswith(b"} \r\n"), f"INFO must end with '}} \\r\\n' (space before CRLF): {line[-20:]!r}"
    assert line.count(b"\r\n") == 1
    info = json.loads(line[5:-3])
    assert isinstance(info["server_id"], str) and info["server_id"]
    assert isinstance(info["server_name"], str) and info["server_name"]
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:[-+].*)?", info["version"])
    assert m, f"version must be semver: {info['version']!r}"
    assert (int(m.group(1)), int(m.group(2))) >= (2, 10), "nats-py feature checks need version >= 2.10"
    assert info["proto"] == 1
    assert info["host"] == "127.0.0.1"
    assert info["port"] == server.port
    assert info["headers"] is True
    assert info["max_payload"] == 1048576
    assert isinstance(info["client_id"], int) and not isinstance(info["client_id"], bool)
    assert info["client_ip"] == "127.0.0.1"
    assert not info.get("auth_required", False)
    await c.close()


async def test_info_has_what_the_modern_nats_py_client_reads(server):
    """nats-core (the modern nats.py client under nats-jetstream and nats-key-value; it needs
    Python 3.13, so it is not installed here) builds its ServerInfo from INFO with
    info["server_id"], info["version"], info["go"], info["host"], info["port"] and
    info["headers"]: a missing key is a KeyError on every connect. The reference also sends
    git_commit and api_lvl."""
    c = await RawClient.open(server.port)
    info = c.info
    for key in ("server_id", "version", "go", "host", "port", "headers"):
        assert key in info, f"INFO lacks {key!r}: {info}"
    assert isinstance(info["go"], str) and info["go"]
    assert isinstance(info["git_commit"], str) and info["git_commit"]
    assert isinstance(info["api_lvl"], int) and info["api_lvl"] >= 1
    await c.close()


async def test_info_client_id_is_per_connection(server):
    a = await RawClient.open(server.port)
    b = await RawClient.open(server.port)
    assert a.info["client_id"] != b.info["client_id"]
    assert a.info["server_id"] == b.info["server_id"]
    await a.close()
    await b.close()


@pytest.mark.server_config(max_payload=1024)
async def test_info_max_payload_from_config(raw):
    c = await raw(connect=False)
    assert c.info["max_payload"] == 1024


async def test_verbose_connect_gets_ok(raw):
    c = await raw(connect=False)
    await c.send(b'CONNECT {"verbose":true,"pedantic":false,"headers":true,"protocol":1}\r\n')
    assert (await c.read_op()).raw == b"+OK\r\n"
    await c.send(b"SUB v.x 1\r\n")
    assert (await c.read_op()).raw == b"+OK\r\n"
    await c.send(b"PUB v.x 5\r\nhello\r\n")
    ops = [await c.read_op(), await c.read_op()]
    assert sorted(o.raw for o in ops) == sorted([b"+OK\r\n", b"MSG v.x 1 5\r\nhello\r\n"])
    await c.send(b"UNSUB 1\r\n")
    assert (await c.read_op()).raw == b"+OK\r\n"
    await c.send(b"PING\r\n")
    assert (await c.read_op()).raw == b"PONG\r\n"


async def test_non_verbose_connect_gets_no_ok(raw):
    c = await raw(connect=False)
    before = await c.connect(verbose=False)
    assert before == []
    await c.send(b"SUB q.x 1\r\nPUB q.x 1\r\na\r\nUNSUB 1\r\n")
    assert [o.raw for o in await c.flush()] == [b"MSG q.x 1 1\r\na\r\n"]


async def test_client_without_connect_is_verbose(raw):
    """No auth configured: a client that never sends CONNECT may still operate and gets +OK per op."""
    c = await raw(connect=False)
    await c.send(b"SUB nc.x 1\r\n")
    assert (await c.read_op()).raw == b"+OK\r\n"
    await c.send(b"PUB nc.x 2\r\nhi\r\n")
    ops = [await c.read_op(), await c.read_op()]
    assert sorted(o.raw for o in ops) == sorted([b"+OK\r\n", b"MSG nc.x 1 2\r\nhi\r\n"])


async def test_ping_pong(raw):
    c = await raw()
    await c.send(b"PING\r\n")
    assert (await c.read_op()).raw == b"PONG\r\n"
    await c.send(b"PING\r\nPING\r\nPING\r\n")
    assert [(await c.read_op()).raw for _ in range(3)] == [b"PONG\r\n"] * 3


async def test_second_info_after_first_pong_protocol_1(raw):
    c = await raw(connect=False)
    first = c.info
    await c.send(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n')
    await c.send(b"PING\r\n")
    assert (await c.read_op()).raw == b"PONG\r\n", "the PONG comes first, the 2nd INFO follows it"
    op = await c.read_op()
    assert op.name == "INFO"
    assert op.raw.endswith(b"} \r\n")
    info = op.json
    assert info["connect_info"] is True
    assert info["server_id"] == first["server_id"]
    assert info["client_id"] == first["client_id"]
    assert info["max_payload"] == first["max_payload"]
    # only once: the next PING gets a bare PONG
    assert await c.flush() == []


async def test_no_second_info_for_protocol_0(raw):
    c = await raw(connect=False)
    await c.send(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":0}\r\nPING\r\nPING\r\n')
    assert (await c.read_op()).raw == b"PONG\r\n"
    assert (await c.read_op()).raw == b"PONG\r\n"
    assert await c.flush() == []


async def test_connect_unknown_fields_ignored_and_second_connect_ok(raw):
    c = await raw(connect=False)
    await c.send(b'CONNECT {"verbose":false,"made_up_field":1}\r\nPING\r\n')
    assert (await c.read_op()).raw == b"PONG\r\n"
    await c.send(b'CONNECT {"verbose":false}\r\nPING\r\n')
    ops = await c.read_until("PONG")
    assert all(o.name == "INFO" for o in ops), ops


# --------------------------------------------------------------------------- operations


async def test_msg_framing_with_reply_and_empty_payload(raw):
    c = await raw()
    await c.send(b"SUB foo 1\r\nSUB foo.* 2\r\n")
    await c.send(b"PUB foo.bar reply.to 5\r\nworld\r\n")
    await c.send(b"PUB foo 0\r\n\r\n")
    ops = await c.flush()
    assert [o.raw for o in ops] == [b"MSG foo.bar 2 reply.to 5\r\nworld\r\n", b"MSG foo 1 0\r\n\r\n"]


async def test_op_names_case_insensitive_and_tabs(raw):
    c = await raw()
    await c.send(b"sub foo.y 3\r\n")
    await c.send(b"pub foo.y 2\r\nlc\r\n")
    await c.send(b"PUB\tfoo.y  3\r\ntab\r\n")
    await c.send(b"Sub\tfoo.z\t4\r\n")
    await c.send(b"pUb\tfoo.z\tr.z\t1\r\nz\r\n")
    await c.send(b"ping\r\n")
    ops = await c.read_until("PONG")
    assert [o.raw for o in ops] == [
        b"MSG foo.y 3 2\r\nlc\r\n",
        b"MSG foo.y 3 3\r\ntab\r\n",
        b"MSG foo.z 4 r.z 1\r\nz\r\n",
    ]
    await c.send(b"unsub 4\r\nPUB foo.z 1\r\nz\r\n")
    assert await c.flush() == []


async def test_natspy_spacing_quirks_accepted(raw):
    """nats-py sends `SUB <subj>  <sid>` (two spaces), `UNSUB <sid> ` (trailing space) and
    `PUB <subj>  <n>` (two spaces, empty reply)."""
    c = await raw()
    await c.send(b"SUB quirk.x  7\r\n")
    await c.send(b"PUB quirk.x  2\r\nhi\r\n")
    assert [o.raw for o in await c.flush()] == [b"MSG quirk.x 7 2\r\nhi\r\n"]
    await c.send(b"UNSUB 7 \r\n")
    await c.send(b"PUB quirk.x 2\r\nhi\r\n")
    assert await c.flush() == []


async def test_queue_group_raw(raw):
    a = await raw()
    b = await raw()
    pub = await raw()
    await a.send(b"SUB qq.x grp 1\r\n")
    await b.send(b"SUB qq.x grp 1\r\n")
    await a.flush()
    await b.flush()
    for i in range(100):
        await pub.send(b"PUB qq.x 3\r\n%03d\r\n" % i)
    await pub.flush()
    got_a = [o.payload for o in await a.flush()]
    got_b = [o.payload for o in await b.flush()]
    assert sorted(got_a + got_b) == [b"%03d" % i for i in range(100)]
    assert got_a and got_b


async def test_unsub_unknown_sid_is_silent(raw):
    c = await raw()
    await c.send(b"UNSUB 999\r\n")
    assert await c.flush() == []


# --------------------------------------------------------------------------- errors


async def test_err_unknown_operation_closes(raw):
    c = await raw()
    await c.send(b"FOO bar\r\n")
    await expect_err_and_close(c, "Unknown Protocol Operation")


async def test_err_payload_longer_than_announced_closes(raw):
    c = await raw()
    await c.send(b"PUB foo 3\r\nhello\r\n")
    await expect_err_and_close(c, "Unknown Protocol Operation")


async def test_err_control_line_too_long_closes(raw):
    c = await raw()
    await c.send(b"PUB " + b"a" * 5000 + b" 1\r\nx\r\n")
    await expect_err_and_close(c, "maximum control line exceeded")


async def test_err_invalid_subject_on_sub_stays_open(raw):
    c = await raw()
    await c.send(b"SUB foo..bar 1\r\n")
    await expect_err_stays_open(c, "Invalid Subject")
    await c.send(b"SUB foo.>.bar 2\r\n")
    await expect_err_stays_open(c, "Invalid Subject")
    # still fully usable
    await c.send(b"SUB ok.x 3\r\nPUB ok.x 2\r\nok\r\n")
    assert [o.raw for o in await c.flush()] == [b"MSG ok.x 3 2\r\nok\r\n"]


async def test_err_pedantic_invalid_publish_subject_stays_open(raw):
    # (no subscriber on the invalid subjects: the reference still routes the message to a
    # matching `>` subscriber after the -ERR; that detail is deliberately not asserted)
    c = await raw(pedantic=True)
    await c.send(b"SUB foo.ok 1\r\n")
    await c.send(b"PUB foo.* 2\r\nhi\r\n")
    await expect_err_stays_open(c, "Invalid Publish Subject")
    await c.send(b"PUB foo..bar 2\r\nhi\r\n")
    await expect_err_stays_open(c, "Invalid Publish Subject")
    await c.send(b"PUB foo.ok 2\r\nhi\r\n")
    assert [o.raw for o in await c.flush()] == [b"MSG foo.ok 1 2\r\nhi\r\n"]


async def test_non_pedantic_invalid_publish_subject_is_accepted(raw):
    c = await raw(pedantic=False)
    await c.send(b"PUB foo..bar 2\r\nhi\r\nPUB foo.* 2\r\nhi\r\nPUB foo.> 2\r\nhi\r\n")
    ops = await c.flush()
    assert not any(o.name == "-ERR" for o in ops), ops


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"PUB foo\r\n", id="pub-without-size"),
        pytest.param(b"SUB foo\r\n", id="sub-without-sid"),
        pytest.param(b"HPUB foo 10 5\r\nNATS/1.0\r\n\r\n", id="hpub-header-size-gt-total"),
    ],
)
async def test_parse_errors_close_silently(raw, data):
    c = await raw()
    await c.send(data)
    rest = await c.read_to_eof(timeout=T)
    assert_only_pings(rest, f"silent close after {data!r}")


async def test_invalid_connect_json_closes_silently(raw):
    c = await raw(connect=False)
    await c.send(b"CONNECT {not json}\r\n")
    rest = await c.read_to_eof(timeout=T)
    assert_only_pings(rest, "invalid CONNECT json")


async def test_hpub_from_headers_false_client_closes_silently(raw):
    c = await raw(headers=False, no_responders=False)
    await c.send(b"HPUB foo 12 14\r\nNATS/1.0\r\n\r\nhi\r\n")
    rest = await c.read_to_eof(timeout=T)
    assert_only_pings(rest, "HPUB by a headers:false client")


async def test_no_responders_requires_headers(raw):
    c = await raw(connect=False)
    await c.send(b'CONNECT {"verbose":false,"pedantic":false,"headers":false,"no_responders":true,"protocol":1}\r\n')
    await c.send(b"PING\r\n")
    await expect_err_and_close(c, "no responders requires headers support")


async def test_garbage_client_does_not_affect_others(server, raw):
    good = await raw()
    await good.send(b"SUB iso.> 1\r\n")
    assert await good.flush() == []
    nc = await nats.connect(server.url, allow_reconnect=False)
    try:
        nsub = await nc.subscribe("iso.>")
        await sync(nc)

        bad = await raw()
        await bad.send(b"FOO bar\r\n")
        await expect_err_and_close(bad, "Unknown Protocol Operation")

        bad2 = await raw(connect=False)
        await bad2.send(bytes(range(256)) * 4 + b"\r\n")
        await bad2.read_to_eof(timeout=T)  # closed (with or without -ERR)

        pub = await raw()
        await pub.send(b"PUB iso.after 5\r\nstill\r\n")
        assert await pub.flush() == []
        assert [o.raw for o in await good.flush()] == [b"MSG iso.after 1 5\r\nstill\r\n"]
        msg = await nsub.next_msg(timeout=T)
        assert (msg.subject, msg.data) == ("iso.after", b"still")
        await nc.flush()
        assert nc.is_connected
    finally:
        await nc.close()


# --------------------------------------------------------------------------- headers


def hpub(subject: bytes, hdr: bytes, body: bytes, reply: bytes = b"") -> bytes:
    mid = subject + (b" " + reply if reply else b"")
    return b"HPUB %s %d %d\r\n" % (mid, len(hdr), len(hdr) + len(body)) + hdr + body + CRLF


@pytest.mark.parametrize(
    "reply,hdr,body",
    [
        pytest.param(b"", b"NATS/1.0\r\nX-One: 1\r\nX-Multi: a\r\nX-Multi: b\r\n\r\n", b"body", id="multi-value"),
        pytest.param(b"reply.x", b"NATS/1.0\r\n\r\n", b"", id="empty-block-with-reply"),
        pytest.param(b"", b"NATS/1.0 503\r\n\r\n", b"p", id="status-line"),
        pytest.param(b"", b"NATS/1.0\r\nlower-case: kept as sent\r\n\r\n", b"", id="lower-case-key"),
        pytest.param(b"", b"NATS/1.0 100 Idle Heartbeat\r\nA: b\r\n\r\n", b"xyz", id="status-description"),
        pytest.param(b"", b"X: y\r\n\r\n", b"", id="block-without-version-line"),
    ],
)
async def test_hpub_hmsg_framing(raw, reply, hdr, body):
    """The header block is forwarded byte-for-byte: HPUB s [r] hdr total -> HMSG s sid [r] hdr total."""
    c = await raw()
    await c.send(b"SUB h.> 1\r\n")
    await c.send(hpub(b"h.a", hdr, body, reply))
    ops = await c.flush()
    mid = b"h.a 1" + (b" " + reply if reply else b"")
    expected = b"HMSG %s %d %d\r\n" % (mid, len(hdr), len(hdr) + len(body)) + hdr + body + CRLF
    assert [o.raw for o in ops] == [expected]


async def test_hmsg_to_other_connection_and_wildcard(raw):
    sub = await raw()
    await sub.send(b"SUB hx.* 9\r\n")
    assert await sub.flush() == []
    pub = await raw()
    hdr = b"NATS/1.0\r\nKey: Value\r\n\r\n"
    await pub.send(hpub(b"hx.one", hdr, b"data", b"_INBOX.r"))
    assert await pub.flush() == []
    ops = await sub.flush()
    assert [o.raw for o in ops] == [b"HMSG hx.one 9 _INBOX.r %d %d\r\n" % (len(hdr), len(hdr) + 4) + hdr + b"data\r\n"]


async def test_headers_false_subscriber_gets_plain_msg(raw):
    plain = await raw(headers=False, no_responders=False)
    await plain.send(b"SUB hh.* 1\r\n")
    assert await plain.flush() == []
    pub = await raw()
    await pub.send(hpub(b"hh.x", b"NATS/1.0\r\nA: b\r\n\r\n", b"body"))
    await pub.send(hpub(b"hh.y", b"NATS/1.0\r\n\r\n", b"body", b"r.y"))
    assert await pub.flush() == []
    ops = await plain.flush()
    assert [o.raw for o in ops] == [b"MSG hh.x 1 4\r\nbody\r\n", b"MSG hh.y 1 r.y 4\r\nbody\r\n"]


# --------------------------------------------------------------------------- no responders


async def test_no_responders_503_byte_exact(raw):
    c = await raw()
    await c.send(b"SUB _INBOX.req 1\r\n")
    await c.send(b"PUB nobody.home _INBOX.req 5\r\nhello\r\n")
    ops = await c.flush()
    assert [o.raw for o in ops] == [
        b"HMSG _INBOX.req 1 43 43\r\nNATS/1.0 503\r\nNats-Subject: nobody.home\r\n\r\n\r\n"
    ]


async def test_no_responders_wildcard_inbox(raw):
    """nats-py style: one wildcard inbox subscription, one reply token per request."""
    c = await raw()
    await c.send(b"SUB _INBOX.abc.*  2\r\n")
    await c.send(b"PUB svc.missing _INBOX.abc.tok1 2\r\nhi\r\n")
    ops = await c.flush()
    hdr = b"NATS/1.0 503\r\nNats-Subject: svc.missing\r\n\r\n"
    assert [o.raw for o in ops] == [b"HMSG _INBOX.abc.tok1 2 %d %d\r\n" % (len(hdr), len(hdr)) + hdr + CRLF]


async def test_no_503_without_reply_subject(raw):
    c = await raw()
    await c.send(b"SUB _INBOX.req 1\r\nPUB nobody.home 5\r\nhello\r\n")
    assert await c.flush() == []


async def test_no_503_when_client_disabled_no_responders(raw):
    c = await raw(no_responders=False)
    await c.send(b"SUB _INBOX.req 1\r\nPUB nobody.home _INBOX.req 5\r\nhello\r\n")
    assert await c.flush() == []


async def test_no_503_when_someone_listens(raw):
    c = await raw()
    await c.send(b"SUB _INBOX.req 1\r\nSUB somebody.home 2\r\nPUB somebody.home _INBOX.req 2\r\nhi\r\n")
    assert [o.raw for o in await c.flush()] == [b"MSG somebody.home 2 _INBOX.req 2\r\nhi\r\n"]

"""Key-value buckets as nats-py 2.16.0 drives them (stream KV_<bucket> on $KV.<bucket>.>):
create, put/get, update with a revision, create-if-absent, delete, purge, history, keys.
The same tests run against the reference with KEEL_TEST_SERVER=nats."""

from __future__ import annotations

import json

import nats.js.errors
import pytest
from nats.js import api

pytestmark = pytest.mark.jetstream

T = 5.0


async def kv_ctx(connect, bucket: str = "cfg", history: int = 5):
    nc = await connect()
    js = nc.jetstream(timeout=T)
    kv = await js.create_key_value(bucket=bucket, history=history)
    return nc, js, kv


async def test_create_bucket_stream_config(connect):
    nc, js, kv = await kv_ctx(connect)
    si = await js.stream_info("KV_cfg")
    cfg = si.config
    assert cfg.subjects == ["$KV.cfg.>"]
    assert cfg.max_msgs_per_subject == 5
    assert cfg.discard == api.DiscardPolicy.NEW
    assert cfg.deny_delete is True
    assert cfg.deny_purge is False
    assert cfg.allow_rollup_hdrs is True
    assert cfg.allow_direct is False  # only sent with direct=True
    raw = json.loads((await nc.request("$JS.API.STREAM.INFO.KV_cfg", b"", timeout=T)).data)
    assert raw["config"]["allow_msg_ttl"] is True
    assert raw["config"]["metadata"]["_nats.req.level"] == "1"

    status = await kv.status()
    assert (status.bucket, status.history, status.values) == ("cfg", 5, 0)

    again = await js.key_value("cfg")
    assert (await again.status()).bucket == "cfg"
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await js.key_value("nope")


async def test_put_get_revisions(connect):
    nc, js, kv = await kv_ctx(connect)
    assert await kv.put("app.color", b"blue") == 1
    assert await kv.put("app.size", b"L") == 2
    assert await kv.put("app.color", b"red") == 3

    entry = await kv.get("app.color")
    assert (entry.key, entry.value, entry.revision) == ("app.color", b"red", 3)
    old = await kv.get("app.color", revision=1)
    assert (old.value, old.revision) == (b"blue", 1)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("missing")


async def test_update_and_create(connect):
    nc, js, kv = await kv_ctx(connect)
    assert await kv.create("k", b"one") == 1
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError) as exc:
        await kv.create("k", b"again")
    assert exc.value.description == "wrong last sequence: 1"

    assert await kv.update("k", b"two", last=1) == 2
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError) as exc:
        await kv.update("k", b"stale", last=1)
    assert exc.value.description == "wrong last sequence: 2"
    assert (await kv.get("k")).value == b"two"

    # create after delete succeeds (nats-py retries with the marker's revision)
    await kv.delete("k")
    assert await kv.create("k", b"reborn") == 4
    assert (await kv.get("k")).value == b"reborn"


async def test_delete_and_purge(connect):
    nc, js, kv = await kv_ctx(connect)
    await kv.put("gone", b"1")
    await kv.put("gone", b"2")
    assert await kv.delete("gone") is True
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("gone")
    assert (await js.stream_info("KV_cfg")).state.messages == 3  # history kept + DEL marker

    last = await js.get_last_msg("KV_cfg", "$KV.cfg.gone")
    assert last.headers["KV-Operation"] == "DEL"
    assert not last.data

    for v in (b"1", b"2", b"3"):
        await kv.put("p", v)
    assert await kv.purge("p") is True
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("p")
    st = (await js.stream_info("KV_cfg")).state
    assert st.messages == 4  # 3 for "gone" + the PURGE marker; older "p" revisions dropped
    history = await kv.history("p")
    assert [e.operation for e in history] == ["PURGE"]


async def test_history(connect):
    nc, js, kv = await kv_ctx(connect)
    for i in range(1, 8):
        await kv.put("k", b"v%d" % i)
    history = await kv.history("k")
    assert [e.revision for e in history] == [3, 4, 5, 6, 7]
    assert [e.value for e in history] == [b"v%d" % i for i in range(3, 8)]
    await kv.delete("k")
    history = await kv.history("k")
    assert len(history) == 5
    assert history[-1].operation == "DEL"
    with pytest.raises(nats.js.errors.NoKeysError):
        await kv.history("never")


async def test_keys(connect):
    nc, js, kv = await kv_ctx(connect, bucket="keys", history=3)
    with pytest.raises(nats.js.errors.NoKeysError):
        await kv.keys()
    for key in ["a", "b", "c", "d.e"]:
        await kv.put(key, b"v")
    await kv.put("a", b"v2")
    assert sorted(await kv.keys()) == ["a", "b", "c", "d.e"]
    await kv.delete("b")
    await kv.purge("c")
    assert sorted(await kv.keys()) == ["a", "d.e"]
    assert (await kv.status()).values == 6

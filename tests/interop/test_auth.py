"""Authentication, permissions, accounts, the system account and reload with nats-py.

Keys, JWTs and bcrypt hashes are made by the tests. Every test also passes against the
reference nats-server (KEEL_TEST_SERVER=nats)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time

import bcrypt
import nats
import nkeys
import pytest

from natsutil import sync

pytestmark = pytest.mark.asyncio

USERS = """
authorization {
  users = [
    {user: alice, password: s3cret}
    {user: bob, password: pw, permissions: {publish: {allow: ["bob.>"]}, subscribe: {allow: ["bob.>", "_INBOX.>"]}}}
  ]
}
"""


async def connect(srv, **opts):
    errors = []

    async def on_error(e):
        errors.append(str(e))

    opts.setdefault("allow_reconnect", False)
    opts.setdefault("connect_timeout", 5)
    opts.setdefault("error_cb", on_error)
    nc = await nats.connect(srv.url, **opts)
    nc.test_errors = errors
    return nc


async def refused(srv, **opts) -> str:
    """Connects expecting a refusal; returns the error text."""
    with pytest.raises(Exception) as e:
        nc = await connect(srv, max_reconnect_attempts=0, **opts)
        await nc.close()
    return str(e.value)


async def test_wrong_password_is_refused(server_factory):
    srv = server_factory(config_text=USERS)
    text = await refused(srv, user="alice", password="nope")
    assert "authorization violation" in text.lower()
    nc = await connect(srv, user="alice", password="s3cret")
    sub = await nc.subscribe("x")
    await nc.publish("x", b"hi")
    msg = await sub.next_msg(timeout=5)
    assert msg.data == b"hi"
    await nc.close()
    assert "nope" not in srv.log_text(10**9)


async def test_bcrypt_password_and_token(server_factory):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    # The reference accepts the $2a$ prefix (what its own tool writes).
    hashed = "$2a$" + hashed[4:]
    srv = server_factory(
        config_text=f'authorization {{ users: [{{user: alice, password: "{hashed}"}}] }}\n'
    )
    nc = await connect(srv, user="alice", password="s3cret")
    await nc.close()
    assert "authorization violation" in (await refused(srv, user="alice", password="x")).lower()

    srv = server_factory(config_text="authorization { token: t0ken }\n")
    nc = await connect(srv, token="t0ken")
    await nc.close()
    assert "authorization violation" in (await refused(srv, token="bad")).lower()


async def test_nkey_user(server_factory, tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    pub = kp.public_key.decode()
    srv = server_factory(config_text=f"authorization {{ users: [{{nkey: {pub}}}] }}\n")
    path = tmp_path / "user.nk"
    path.write_bytes(seed)
    nc = await connect(srv, nkeys_seed=str(path))
    await sync(nc)
    await nc.close()
    other = tmp_path / "other.nk"
    other.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    assert "authorization violation" in (await refused(srv, nkeys_seed=str(other))).lower()


async def test_denied_publish_and_subscribe(server_factory):
    srv = server_factory(config_text=USERS)
    alice = await connect(srv, user="alice", password="s3cret")
    seen = await alice.subscribe("alice.>")
    await sync(alice)
    bob = await connect(srv, user="bob", password="pw")
    await bob.publish("alice.x", b"no")
    await bob.subscribe("alice.>")
    # (No sync(): bob may not publish to its inbox.)
    await bob.flush()
    # Both refusals reach the error callback; the connection stays.
    deadline = time.monotonic() + 5
    while len(bob.test_errors) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # waiting for the error callback
    errors = " ".join(bob.test_errors).lower()
    assert 'permissions violation for publish to "alice.x"' in errors
    assert 'permissions violation for subscription to "alice.>"' in errors
    assert bob.is_connected
    with pytest.raises(nats.errors.TimeoutError):
        await seen.next_msg(timeout=0.3)
    await bob.close()
    await alice.close()


ACCOUNTS = """
accounts {
  A: {
    users: [{user: a, password: a}]
    exports: [{stream: "events.>"}, {service: "help"}]
  }
  B: {
    users: [{user: b, password: b}]
    imports: [
      {stream: {account: A, subject: "events.>"}, prefix: "from_a"}
      {service: {account: A, subject: "help"}, to: "a.help"}
    ]
  }
}
"""


async def test_cross_account_stream_and_service(server_factory):
    srv = server_factory(config_text=ACCOUNTS)
    a = await connect(srv, user="a", password="a")
    b = await connect(srv, user="b", password="b")

    async def answer(msg):
        await msg.respond(b"help from A")

    await a.subscribe("help", cb=answer)
    events = await b.subscribe("from_a.events.>")
    local = await b.subscribe("events.>")
    await sync(a)
    await sync(b)
    await a.publish("events.created", b"e1")
    await a.flush()
    msg = await events.next_msg(timeout=5)
    assert (msg.subject, msg.data) == ("from_a.events.created", b"e1")
    with pytest.raises(nats.errors.TimeoutError):
        await local.next_msg(timeout=0.3)
    resp = await b.request("a.help", b"?", timeout=5)
    assert resp.data == b"help from A"
    await a.close()
    await b.close()


SYSTEM = """
accounts {
  SYS: { users: [{user: sys, password: sys}] }
  A: { users: [{user: a, password: a}] }
}
system_account: SYS
"""


async def test_system_account_requests(server_factory):
    srv = server_factory(config_text=SYSTEM)
    sys_nc = await connect(srv, user="sys", password="sys")
    events = await sys_nc.subscribe("$SYS.ACCOUNT.A.CONNECT")
    await sync(sys_nc)
    a = await connect(srv, user="a", password="a", name="py-a")
    ev = json.loads((await events.next_msg(timeout=5)).data)
    assert ev["type"] == "io.nats.server.advisory.v1.client_connect"
    assert (ev["client"]["acc"], ev["client"]["user"]) == ("A", "a")

    ping = json.loads((await sys_nc.request("$SYS.REQ.SERVER.PING", b"", timeout=5)).data)
    assert set(ping) >= {"server", "statsz"}
    sid = ping["server"]["id"]
    varz = json.loads((await sys_nc.request(f"$SYS.REQ.SERVER.{sid}.VARZ", b"", timeout=5)).data)
    assert varz["data"]["server_id"] == sid
    jsz = json.loads((await sys_nc.request("$SYS.REQ.SERVER.PING.JSZ", b"", timeout=5)).data)
    assert "data" in jsz
    info = json.loads((await sys_nc.request("$SYS.REQ.ACCOUNT.A.INFO", b"", timeout=5)).data)
    assert info["data"]["account_name"] == "A"
    # A user of A asks who it is, through the system account's import.
    me = json.loads((await a.request("$SYS.REQ.USER.INFO", b"", timeout=5)).data)
    assert (me["data"]["user"], me["data"]["account"]) == ("a", "A")
    await a.close()
    await sys_nc.close()


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _jwt(signer, claims: dict) -> str:
    claims = dict(claims, jti=_b64(os.urandom(16)), iat=int(time.time()) - 10)
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = signer.sign(f"{head}.{body}".encode())
    return f"{head}.{body}.{_b64(sig)}"


def _kp(prefix):
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return nkeys.from_seed(bytearray(seed)), seed


def _pub(kp) -> str:
    return kp.public_key.decode()


async def test_creds_and_expired_jwt(server_factory, tmp_path):
    op, _ = _kp(nkeys.PREFIX_BYTE_OPERATOR)
    acc, _ = _kp(nkeys.PREFIX_BYTE_ACCOUNT)
    user, user_seed = _kp(nkeys.PREFIX_BYTE_USER)
    limits = {"subs": -1, "conn": -1, "leaf": -1, "imports": -1, "exports": -1, "data": -1,
              "payload": -1, "wildcards": True}
    op_jwt = _jwt(op, {"iss": _pub(op), "sub": _pub(op), "name": "OP",
                       "nats": {"type": "operator", "version": 2}})
    acc_jwt = _jwt(op, {"iss": _pub(op), "sub": _pub(acc), "name": "APP",
                        "nats": {"type": "account", "version": 2, "limits": limits}})
    srv = server_factory(config_text=(
        f"operator: {op_jwt}\nresolver: MEMORY\nresolver_preload {{ {_pub(acc)}: {acc_jwt} }}\n"
    ))

    def creds(exp: int) -> str:
        token = _jwt(acc, {"iss": _pub(acc), "sub": _pub(user), "name": "u", "exp": exp,
                           "nats": {"type": "user", "version": 2, "subs": -1, "data": -1,
                                    "payload": -1}})
        path = tmp_path / f"u{exp}.creds"
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        return str(path)

    nc = await connect(srv, user_credentials=creds(int(time.time()) + 3600))
    sub = await nc.subscribe("app.x")
    await nc.publish("app.x", b"jwt")
    assert (await sub.next_msg(timeout=5)).data == b"jwt"
    await nc.close()
    text = await refused(srv, user_credentials=creds(int(time.time()) - 60))
    assert "authorization violation" in text.lower() or "expired" in text.lower()


RELOAD_AFTER = """
authorization { users = [
  {user: keep, password: k}
  {user: new, password: n}
] }
"""


async def test_reload_users(server_factory):
    srv = server_factory(config_text="""
authorization { users = [
  {user: keep, password: k}
  {user: gone, password: g}
] }
""")
    keep = await connect(srv, user="keep", password="k")
    closed = asyncio.Event()

    async def on_closed():
        closed.set()

    gone = await connect(srv, user="gone", password="g", closed_cb=on_closed)
    srv.reload(RELOAD_AFTER)
    await asyncio.wait_for(closed.wait(), 5)
    assert gone.is_closed
    await sync(keep)
    assert keep.is_connected
    new = await connect(srv, user="new", password="n")
    await new.close()
    assert "authorization violation" in (await refused(srv, user="gone", password="g")).lower()
    await keep.close()

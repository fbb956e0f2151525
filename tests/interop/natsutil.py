"""Helpers for nats-py clients."""

from __future__ import annotations

T = 5.0


async def sync(nc, timeout: float = T) -> None:
    """Ordered round trip through the server for a nats-py connection.

    nats-py 2.16.0's `flush()` writes its PING straight to the transport while
    earlier SUB/PUB commands may still sit in the client's pending buffer, so the
    PONG does not prove those commands were processed.  Instead publish to a
    private inbox the connection itself subscribes to and wait for that message:
    commands on one connection are processed in order, so when it arrives every
    earlier SUB/PUB has been handled (and the messages routed to all subscribers).

    Needs echo (do not use on a no_echo connection).
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(inbox, b"")
    await sub.next_msg(timeout=timeout)
    await sub.unsubscribe()


async def drain_until(sub, sentinel: bytes, timeout: float = T) -> list:
    """Return the messages received on `sub` before the one whose payload is `sentinel`."""
    got = []
    while True:
        msg = await sub.next_msg(timeout=timeout)
        if msg.data == sentinel:
            return got
        got.append(msg)


async def pending(sub) -> list:
    """All messages already buffered client-side (call after `sync` of publisher and receiver)."""
    return [await sub.next_msg(timeout=T) for _ in range(sub.pending_msgs)]

"""A minimal raw-socket NATS protocol client (asyncio streams) for byte-level tests."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field

CRLF = b"\r\n"
DEFAULT_TIMEOUT = 5.0

# CONNECT sent by the raw client unless a test overrides fields (same as the reference captures).
DEFAULT_CONNECT = {
    "verbose": False,
    "pedantic": False,
    "headers": True,
    "no_responders": True,
    "protocol": 1,
    "lang": "raw-interop",
    "version": "0",
}


@dataclass
class Op:
    name: str  # upper-cased op name: INFO MSG HMSG PING PONG +OK -ERR
    line: bytes  # the control line without CRLF
    args: list = field(default_factory=list)  # control-line arguments (bytes)
    payload: bytes = b""  # MSG payload / HMSG header block + payload (without trailing CRLF)
    raw: bytes = b""  # every byte of this op as received, including CRLFs

    # -- conveniences ---------------------------------------------------
    @property
    def subject(self) -> str:
        return self.args[0].decode()

    @property
    def sid(self) -> str:
        return self.args[1].decode()

    @property
    def reply(self) -> str | None:
        n = 5 if self.name == "HMSG" else 4
        return self.args[2].decode() if len(self.args) == n else None

    @property
    def json(self) -> dict:
        assert self.name == "INFO", self
        return json.loads(self.line[5:])

    @property
    def err(self) -> str:
        assert self.name == "-ERR", self
        return self.line[5:].decode()

    def __repr__(self) -> str:
        return f"Op({self.name}, {self.raw[:300]!r})"


class ConnectionClosed(Exception):
    """The server closed the connection while an op was expected."""

    def __init__(self, pending: bytes = b""):
        super().__init__(f"connection closed by server (unparsed tail {pending[:200]!r})")
        self.pending = pending


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.info: dict = {}
        self.info_line: bytes = b""
        self.server_pings = 0  # PINGs received from the server (and answered if auto_pong)
        self.auto_pong = True

    # -- setup ---------------------------------------------------------
    @classmethod
    async def open(cls, port: int, *, rcvbuf: int | None = None, read_info: bool = True,
                   host: str = "127.0.0.1", timeout: float = DEFAULT_TIMEOUT) -> "RawClient":
        if rcvbuf is None:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=1 << 20), timeout)
        else:
            # set SO_RCVBUF before connect so the TCP window is really small
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout)
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        client = cls(reader, writer)
        if read_info:
            op = await client.read_op(timeout=timeout)
            assert op.name == "INFO", f"server must greet with INFO, got {op!r}"
            client.info_line = op.raw
            client.info = op.json
        return client

    async def connect(self, timeout: float = DEFAULT_TIMEOUT, **fields) -> list[Op]:
        """Send CONNECT (+ PING) and wait for the PONG.

        Returns the ops received before the PONG (e.g. +OK for verbose).  For
        protocol>=1 the second INFO that follows the PONG is consumed too and
        stored in `self.connect_info`."""
        opts = dict(DEFAULT_CONNECT)
        opts.update(fields)
        await self.send(b"CONNECT " + json.dumps(opts, separators=(",", ":")).encode() + CRLF + b"PING\r\n")
        before = await self.read_until("PONG", timeout=timeout)
        self.connect_info = None
        if opts.get("protocol", 0) >= 1:
            op = await self.read_op(timeout=timeout)
            assert op.name == "INFO" and op.json.get("connect_info") is True, (
                f"protocol:1 client expects a 2nd INFO with connect_info after the first PONG, got {op!r}")
            self.connect_info = op.json
        return before

    # -- io ------------------------------------------------------------
    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _readline(self, timeout: float) -> bytes:
        try:
            line = await asyncio.wait_for(self.reader.readuntil(CRLF), timeout)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionClosed(exc.partial) from None
        except (ConnectionResetError, BrokenPipeError):
            raise ConnectionClosed() from None
        return line

    async def _readexactly(self, n: int, timeout: float) -> bytes:
        try:
            return await asyncio.wait_for(self.reader.readexactly(n), timeout)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionClosed(exc.partial) from None
        except (ConnectionResetError, BrokenPipeError):
            raise ConnectionClosed() from None

    async def read_op(self, timeout: float = DEFAULT_TIMEOUT, skip_ping: bool = True) -> Op:
        """Read the next op. Server PINGs are answered and skipped unless skip_ping=False
        (or auto_pong is off, in which case they are returned)."""
        while True:
            raw = await self._readline(timeout)
            line = raw[:-2]
            parts = line.split()
            if not parts:
                raise AssertionError(f"empty control line from server: {raw!r}")
            name = parts[0].decode(errors="replace").upper()
            args = parts[1:]
            payload = b""
            if name == "MSG":
                size = int(args[-1])
                body = await self._readexactly(size + 2, timeout)
                assert body.endswith(CRLF), f"MSG payload not followed by CRLF: {body[-10:]!r}"
                payload = body[:-2]
                raw += body
            elif name == "HMSG":
                total = int(args[-1])
                body = await self._readexactly(total + 2, timeout)
                assert body.endswith(CRLF), f"HMSG payload not followed by CRLF: {body[-10:]!r}"
                payload = body[:-2]
                raw += body
            op = Op(name, line, args, payload, raw)
            if name == "PING":
                self.server_pings += 1
                if skip_ping and self.auto_pong:
                    await self.send(b"PONG\r\n")
                    continue
            return op

    async def read_until(self, name: str, timeout: float = DEFAULT_TIMEOUT) -> list[Op]:
        """Read ops until one named `name`; return the ops before it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = []
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"no {name} within {timeout}s; got {seen!r}")
            op = await self.read_op(timeout=remaining)
            if op.name == name:
                return seen
            seen.append(op)

    async def flush(self, timeout: float = DEFAULT_TIMEOUT) -> list[Op]:
        """PING and wait for the PONG; returns the ops that arrived before it."""
        await self.send(b"PING\r\n")
        return await self.read_until("PONG", timeout=timeout)

    async def read_to_eof(self, timeout: float = DEFAULT_TIMEOUT) -> bytes:
        """Read everything until the server closes the connection.

        Returns the bytes received; raises AssertionError if the connection is
        still open after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        data = bytearray()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(
                    f"server did not close the connection within {timeout}s (received {bytes(data[:300])!r})")
            try:
                chunk = await asyncio.wait_for(self.reader.read(65536), remaining)
            except asyncio.TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                return bytes(data)
            if not chunk:
                return bytes(data)
            data += chunk

    async def close(self) -> None:
        try:
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 2)
        except Exception:
            pass


"""What happens to a connection before it carries a request, where no ASGI middleware can see it: uvicorn keeps a
connection that sends nothing, or trickles its request line and headers, open for ever, and accepts any number of
them, each holding a file descriptor. Here a request's head must arrive within `--max-head-seconds` (then 408 and
the connection is closed; one that sent nothing is closed without a word), and at most twice `--max-connections`
connections are open at once: past that a new one is closed as it opens, while up to that the surplus still reads
a 429 from the guard (and a supervisor's /health its answer). The server's socket is bound before the models load
(`listening_socket`)."""

from __future__ import annotations

import asyncio
import socket

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from roads_to_rome.errors import R2RError
from roads_to_rome.serving.errors import error_response
from roads_to_rome.serving.limits import Limits


def uvicorn_config(app: FastAPI, host: str, port: int, **options) -> uvicorn.Config:
    """uvicorn's settings for an app of create_app's (its limits in `app.state.r2r`), or for any other with the
    default limits."""
    state = getattr(app.state, "r2r", None)
    limits = state.limits if state is not None else Limits()
    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=guarded_protocol(limits), **options)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound at once (as vLLM binds before it loads its engine): a port already in use, or an
    address this machine does not have, is said before the models load for seconds to minutes, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (uvicorn's rule)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise R2RError(f"cannot listen on {host}:{port}: {e.strerror or e}. Another process may hold the port: give "
                       "another --port, or stop that process") from None
    return sock


def guarded_protocol(limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (h11, whatever else is installed: one behaviour everywhere) with the head's
    deadline and the cap on open connections."""

    class GuardedH11(H11Protocol):
        head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            if len(self.connections) > 2 * limits.max_connections:
                transport.abort()  # no word: what is past the cap must cost nothing, not even a reply
                return
            self.watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watch_head()

        def connection_lost(self, exc):
            self.stop_watching()
            super().connection_lost(exc)

        def watch_head(self) -> None:
            """Armed while the connection is between requests and either new (nothing sent yet) or part-way through
            a head; between requests with nothing begun, uvicorn's keep-alive timeout governs instead."""
            in_head = self.conn.their_state is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0]))
            if not in_head or self.transport.is_closing():
                self.stop_watching()
            elif self.head_deadline is None:
                self.head_deadline = self.loop.call_later(limits.max_head_seconds, self.head_overdue)

        def stop_watching(self) -> None:
            if self.head_deadline is not None:
                self.head_deadline.cancel()
                self.head_deadline = None

        def head_overdue(self) -> None:
            self.head_deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:
                self.transport.write(head_timeout_reply(limits.max_head_seconds))
            self.transport.close()

    return GuardedH11


def head_timeout_reply(seconds: float) -> bytes:
    """A 408 in OpenAI's error shape, written raw: no request was parsed for h11 to answer."""
    reply = error_response(408, f"the request's line and headers did not arrive within {seconds:g} s "
                                "(--max-head-seconds)", code="request_timeout")
    head = [b"HTTP/1.1 408 Request Timeout", *(b"%s: %s" % kv for kv in reply.raw_headers), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + reply.body

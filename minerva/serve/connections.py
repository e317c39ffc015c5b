"""Connection deadlines for uvicorn: a request head must arrive in time, and open connections are capped.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) but not a client that
opens a connection and then sends its request head a byte at a time (slowloris), and it
has no cap on open connections that answers before a request head arrives. `http_protocol`
returns uvicorn's h11 protocol class with both added; the body's deadline is the `Guard`
middleware's (`minerva.serve.app`), since the app is what reads the body.

- Header timeout: from the moment a connection opens, and again whenever a response ends,
  the client has `header_timeout` seconds to send a complete request head. Past it, a client
  that sent part of a head gets a 408; one that sent nothing (an idle keep-alive connection)
  is just closed, so a pooling client never finds a stale 408 on a connection it reuses.
- Connection cap: a connection that opens while `max_connections` are already open gets a
  503 with Retry-After at once and is closed.

Both answers are written as raw bytes (h11 refuses a response before it has parsed a
request), then the write side is shut (FIN) and the socket is closed on the client's EOF or
after LINGER seconds: closing at once, with the client's bytes still unread, would send a
reset that can destroy the answer before the client reads it.

What this relies on in uvicorn (checked against 0.54.0; each is present in both its h11 and
httptools protocols): the protocol class can be passed as `Config(http=cls)` and is built
once per connection; `connection_made`, `data_received`, `connection_lost` and
`on_response_complete` (called when a response has been sent) as the hooks; `self.cycle` is
replaced by a new request cycle exactly when a request head has been parsed, and
`cycle.response_complete` says whether its response has ended; `self.connections` is the
server's set of open connections (this one included); `self.loop` and `self.transport`.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from minerva.serve import convert

LINGER = 1.0  # seconds a refused or timed-out connection waits for the client's EOF before closing


def refusal(status: int, message: str, type: str, headers: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI error body that closes the connection."""
    body = json.dumps(convert.error_body(status, message, None, type)).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class Deadlines:
    """Mixed in before uvicorn's protocol class (see `http_protocol`), which it extends through
    the hooks named in the module docstring."""

    header_timeout: float
    max_connections: int

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_timer = self.linger_timer = None
        self.answered = False  # a raw answer was written: what the client sends now is dropped
        if len(self.connections) > self.max_connections:
            self.answer_and_close(refusal(
                503, f"the server has {self.max_connections} connections open (its --max-connections); "
                     f"retry later", "server_overloaded", ("retry-after: 1",)))
        else:
            self.await_head()

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head was parsed: its app runs, no deadline until it answers
            self.cancel_head_timer()
        else:
            self.partial_head = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined head already parsed (a new cycle not yet answered) needs no deadline.
        if self.cycle.response_complete and not self.transport.is_closing():
            self.await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        super().connection_lost(exc)

    def await_head(self) -> None:
        self.cancel_head_timer()
        self.partial_head = False
        self.head_timer = self.loop.call_later(self.header_timeout, self.head_timed_out)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if not self.partial_head:
            self.transport.close()
            return
        self.answer_and_close(refusal(
            408, f"the request head did not arrive within {self.header_timeout:g} s (the server's "
                 f"--header-timeout)", "invalid_request_error"))

    def answer_and_close(self, response: bytes) -> None:
        self.answered = True
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then EOF
        self.linger_timer = self.loop.call_later(LINGER, self.transport.close)


def http_protocol(header_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with the deadlines, for `uvicorn.Config(http=...)`. Pinned to h11,
    not uvicorn's "auto" (httptools when installed), so the server runs the protocol its tests run."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return type("DeadlineH11Protocol", (Deadlines, H11Protocol),
                {"header_timeout": header_timeout, "max_connections": max_connections})

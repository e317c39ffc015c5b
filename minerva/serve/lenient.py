"""What clients send beyond the fields Minerva implements, and how it reads their bodies.

Real clients fill in fields that cannot change a completion: OpenAI's SDKs and agents send
`store`, `metadata`, `service_tier`, `prompt_cache_key`; llama.cpp's clients send
`cache_prompt` and a slot id; vLLM's send `priority`. Refusing them with a 400 breaks clients
that work with every other server, so they are dropped before validation and named in the
response's `X-Minerva-Ignored-Fields` header. A field that would change the output and that
Minerva does not implement stays a 400 naming it (`protocol.py`), so nothing is silently
answered differently from what was asked.

A body sent without `Content-Type: application/json` (curl's `-d` says
`application/x-www-form-urlencoded`; some clients say nothing or `text/plain`) is read as
JSON when it is JSON.
"""

from __future__ import annotations

import json

# top-level fields that ask for nothing a completion depends on -> None (any value), or the
# values that ask for nothing (any other value stays a field Minerva does not implement)
IGNORED: dict[str, tuple | None] = {
    # OpenAI: storage and bookkeeping on OpenAI's side, latency tiers, cache routing hints
    "store": None, "metadata": None, "service_tier": None, "prompt_cache_key": None,
    "safety_identifier": None, "prediction": None, "modalities": (["text"],),
    "prompt_cache_retention": None,
    # llama.cpp: its prompt cache and slots (Minerva's prefix cache is always on)
    "cache_prompt": None, "id_slot": None, "slot_id": None, "timings_per_token": None,
    # vLLM: scheduling priority and its prefix cache's salt
    "priority": None, "cache_salt": None,
    # Ollama's OpenAI-compatible routes
    "keep_alive": None,
}
# the routes whose bodies are relaxed: the OpenAI-compatible API
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
HEADER = b"x-minerva-ignored-fields"


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (`application/json`, `…+json`)."""
    if not content_type:
        return False
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


def relax(body: bytes, content_type: str | None, drop: bool = True) -> tuple[bytes, list[str], bool]:
    """The body with the ignored fields taken out (with `drop`), their names, and whether the
    body is JSON under another (or no) Content-Type. A body that is not a JSON object is returned as it
    is, for the route's own parser to refuse (as JSON whatever its Content-Type: what the routes
    take)."""
    retyped = not is_json(content_type)
    if not retyped and not (drop and any(b'"%s"' % k.encode() in body for k in IGNORED)):
        return body, [], False  # JSON, naming no ignored field: left for the route's parser alone
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # (under another type too: the route's parser says where it breaks)
        return body, [], retyped
    if not isinstance(value, dict) or not drop:
        return body, [], retyped
    dropped = [k for k, neutral in IGNORED.items() if k in value and (neutral is None or value[k] in neutral)]
    if not dropped:
        return body, [], retyped
    for k in dropped:
        del value[k]
    return json.dumps(value).encode(), dropped, retyped


def with_headers(scope: dict, body: bytes, retyped: bool) -> dict:
    """The request's scope for a rewritten body: its Content-Length, and a JSON Content-Type
    where the body was JSON under another."""
    drop = {b"content-length"} | ({b"content-type"} if retyped else set())
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
    headers.append((b"content-length", str(len(body)).encode()))
    if retyped:
        headers.append((b"content-type", b"application/json"))
    return {**scope, "headers": headers}


def naming(send, fields: list[str]):
    """`send` with the response's start naming the ignored fields in its headers."""
    value = ", ".join(fields).encode()

    async def sent(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (HEADER, value)]}
        await send(message)
    return sent


def parse_origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: `*`, origins separated by commas, or vLLM's JSON list."""
    text = text.strip()
    try:
        value = json.loads(text) if text.startswith("[") else [o.strip() for o in text.split(",")]
    except ValueError:
        value = None
    if not isinstance(value, list) or not value or not all(isinstance(o, str) and o for o in value):
        raise ValueError(f"give '*', origins separated by commas "
                         f"(http://localhost:3000,https://chat.example.com) or a JSON list; got {text!r}")
    if "*" in value:
        return ("*",)
    bad = next((o for o in value if "://" not in o or o.endswith("/")), None)
    if bad is not None:
        raise ValueError(f"'{bad}' is not an origin; write scheme://host[:port], "
                         f"without a path (e.g. http://localhost:3000)")
    return tuple(value)

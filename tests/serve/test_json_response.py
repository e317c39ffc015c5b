"""The server's JSON responses (minerva/serve/json_response.py): a body holding a string no
UTF-8 can carry (a lone surrogate) is written with its strings escaped, not a 500; every other
body as Starlette writes it."""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse as StarletteJSON

from minerva.serve.json_response import JSONResponse


def test_a_lone_surrogate_is_escaped_and_the_rest_written_as_starlette_does():
    body = {"input": {"a": "\ud800", "b": "é"}, "n": [1, 2.5]}
    with pytest.raises(UnicodeEncodeError):
        StarletteJSON(body)
    out = JSONResponse(body).body
    assert out.isascii() and json.loads(out) == body
    plain = {"text": "é 😀", "n": [1, None, True]}
    assert JSONResponse(plain).body == StarletteJSON(plain).body
    assert JSONResponse(plain, status_code=400).status_code == 400
    with pytest.raises(ValueError):  # NaN is not JSON, whichever way it is written
        JSONResponse({"x": float("nan")})

"""The server's JSON responses.

Starlette's JSONResponse writes str as UTF-8, which has no form for a lone surrogate: a string
holding one (an escape such as \\ud800 in a model's tool call, read back by a JSON reader)
would fail the whole response with a 500 where the same reply streamed (JSON with ASCII
escapes) goes through. This one writes such a body with its strings escaped, as the stream
does; every other body byte for byte as Starlette's.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse as _StarletteJSON


class JSONResponse(_StarletteJSON):
    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("ascii")

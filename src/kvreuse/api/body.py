"""A raw request body -> JSON, or an ``APIError`` (400) that names the body and what is wrong.

The executor (through its exception handlers, for the bodies FastAPI could not parse) and
the router (before it tokenizes anything) give the same message for the same body:

    invalid UTF-8      "request body is not valid UTF-8 (byte 2 of 9: 0xff)"
    nested too deep    "request body: JSON is nested too deeply (arrays or objects about 1000 levels deep)"
    not JSON           "request body is not valid JSON: Expecting value: line 1 column 1 (char 0)"

Parsing is ``json.loads`` (C); nesting beyond what it can recurse into (the interpreter's
recursion limit, 1000 by default) is reported, not raised as a ``RecursionError``.
"""

from __future__ import annotations

import json
from typing import Any

from kvreuse.api.errors import APIError


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of ``raw``. Raises ``APIError`` (400, ``param`` None) for a body that
    is not UTF-8, nests deeper than the parser can recurse, or is not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(
            f"request body is not valid UTF-8 (byte {exc.start} of {len(raw)}: 0x{raw[exc.start]:02x})"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise APIError("request body: JSON is nested too deeply (arrays or objects about 1000 levels deep)") from None
    except ValueError as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None


def check_text(text: str, param: str) -> str:
    """``text`` unchanged, or ``APIError`` (400 naming ``param``) when it holds a lone UTF-16
    surrogate (``"\\ud800"`` in JSON), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(
            f"{param}: text contains a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x} at "
            f"character {exc.start}); send valid Unicode",
            param=param,
        ) from None
    return text

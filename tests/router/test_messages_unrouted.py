"""A method or path under /v1/messages that no router route serves is answered in Anthropic's
error shape (the official client reads ``error.type``), as the executor answers it, not
Starlette's ``{"detail": ...}``."""

from __future__ import annotations

from .test_guards import KEY, _bearer, _call


def test_an_unrouted_messages_method_or_path_is_anthropics_error():
    (get, unknown, chat), seen, calls = _call(
        [
            ("GET", "/v1/messages", b"", _bearer(KEY)),
            ("POST", "/v1/messages/nope", b"{}", _bearer(KEY)),
            ("GET", "/v1/chat/completions", b"", _bearer(KEY)),
        ]
    )
    assert get.status_code == 405
    assert get.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}}
    assert unknown.status_code == 404
    assert unknown.json() == {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}
    assert chat.status_code == 405 and chat.json() == {"detail": "Method Not Allowed"}  # other paths untouched
    assert (seen, calls) == ([], 0)

"""messages_format: stop reasons (which stop sequence cut the text) and the usage body."""

from __future__ import annotations

from kvreuse.api.cache_breakpoints import Breakpoint, BreakpointPolicy, Segment
from kvreuse.engine.outputs import RequestOutput
from kvreuse.server.messages_format import message_body, stop_reason, usage_body


class Chars:
    """A tokenizer whose token i is chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _out(text: str, ids: str, reason: str | None, finished: bool = True, **extra) -> RequestOutput:
    return RequestOutput("r", [1] * 40, [ord(c) for c in ids], [], text, "", finished, reason, 40, 32, 0.1, **extra)


def test_stop_reasons():
    assert stop_reason(_out("ab", "ab", "length"), Chars(), ("x",)) == ("max_tokens", None)
    assert stop_reason(_out("ab", "abEND", "stop"), Chars(), ("END", "EN")) == ("stop_sequence", "EN")  # the engine's
    assert stop_reason(_out("ab", "ab", "stop"), Chars(), ("END",)) == ("end_turn", None)  # EOS
    assert stop_reason(_out("ab", "ab", None, finished=False), Chars(), ()) == (None, None)


def test_usage_body_counts_as_the_plan_says():
    plan = BreakpointPolicy().plan([Segment(frozenset({"system"}), 0, 36)], [Breakpoint(0, "1h", "system")])
    out = _out("ab", "ab", "stop", cached_tokens_by_tier={"GPU": 16, "CPU": 16})
    assert usage_body(plan, out, 16) == {
        "input_tokens": 8,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 32,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 2,
        "kvreuse": {"cache_read_input_tokens_by_tier": {"device": 16, "host": 16, "disk": 0, "remote": 0, "object": 0}},
    }
    body = message_body("msg_1", "m", "", ("end_turn", None), {}, [{"type": "tool_use"}])
    assert body["content"] == [{"type": "tool_use"}] and body["stop_reason"] == "end_turn"

"""messages_tools: a reply's <tool_call> blocks -> Anthropic tool_use blocks, whole or streamed."""

from __future__ import annotations

import json

from kvreuse.server.messages_tools import ToolStream, held_back, split_tool_calls


def _events(chunks) -> list[tuple[str, dict]]:
    out = []
    for frame in "".join(chunks).strip().split("\n\n"):
        name, data = frame.split("\n", 1)
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_calls_after_text_become_tool_use_blocks():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>\n'
    )
    before, calls = split_tool_calls(text)
    assert before == "Let me check."
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("toolu_") and len(c.id) == 30 for c in calls)
    assert calls[0].block() == {
        "type": "tool_use",
        "id": calls[0].id,
        "name": "get_weather",
        "input": {"city": "Paris"},
    }


def test_malformed_calls_stay_text():
    for text in (
        "no calls",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> trailing words',
        '<tool_call>{"name": "f", "arguments": {}}',
    ):
        assert split_tool_calls(text) == (text, [])


def test_held_back_stops_at_a_marker_or_its_start():
    assert held_back("plain text") == 10
    assert held_back("text <tool") == 5
    assert held_back("text <tool_call>{") == 5
    assert held_back("a <b") == 4  # "<b" cannot start the marker


def test_a_streamed_reply_sends_text_then_tool_use_blocks():
    stream = ToolStream()
    pieces = ["Checking", " now <to", 'ol_call>{"name": "f", "argu', 'ments": {"x": 1}}</tool_call>']
    events = _events([e for p in pieces for e in stream.feed(p)] + list(stream.finish(True)))
    assert [(n, p.get("delta", p.get("content_block"))) for n, p in events] == [
        ("content_block_delta", {"type": "text_delta", "text": "Checking"}),
        ("content_block_delta", {"type": "text_delta", "text": " now "}),
        ("content_block_stop", None),
        ("content_block_start", {"type": "tool_use", "id": stream.calls[0].id, "name": "f", "input": {}}),
        ("content_block_delta", {"type": "input_json_delta", "partial_json": '{"x": 1}'}),
        ("content_block_stop", None),
    ]
    assert [p["index"] for _, p in events] == [0, 0, 0, 1, 1, 1]


def test_a_streamed_reply_without_calls_sends_its_held_text():
    stream = ToolStream()
    events = _events([*stream.feed("a <tool"), *stream.finish(True)])
    assert [p.get("delta", {}).get("text") for _, p in events] == ["a ", "<tool", None]
    stream = ToolStream()  # cut by max_tokens: calls not accepted, the text goes out as text
    events = _events([*stream.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>'), *stream.finish(False)])
    assert events[0][1]["delta"]["text"].startswith("<tool_call>") and stream.calls == []

"""The streaming parser for JSON-list tool calls: the same events whatever the split points, names
announced when their string closes, arguments streamed so that they join to the exact JSON text,
and defined behaviour for output no grammar constrained."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from structured_helpers import merged  # the parent directory's conftest puts it on the path

from llm_shared.structured import ArgumentsDelta, CallDone, CallStarted, TextDelta, ToolCallEvent
from llm_shared.structured.families.json_calls import JsonCallListParser

ARGS_0 = '{"city": "Pa\\"ris }]", "n": [1, {"a": 2}], "u": "\\u00e9\\\\"}'
OUTPUT = (
    'Sure <tool thing. <tool_call>[\n{"name": "get_weather", "arguments": ' + ARGS_0 + "},\n"
    '{"arguments": {"x": -1.5e3}, "name": "b\\u00e9"}, {"name": "c", "arguments": 5}, {"name": "ping"}\n'
    "]</tool_call> after <tool_ca"
)
EXPECTED: list[ToolCallEvent] = [
    TextDelta("Sure <tool thing. "),
    CallStarted(0, "get_weather"),
    ArgumentsDelta(0, ARGS_0),
    CallDone(0, "get_weather", ARGS_0),
    CallStarted(1, "bé"),
    ArgumentsDelta(1, '{"x": -1.5e3}'),
    CallDone(1, "bé", '{"x": -1.5e3}'),
    CallStarted(2, "c"),
    ArgumentsDelta(2, "5"),
    CallDone(2, "c", "5"),
    CallStarted(3, "ping"),
    ArgumentsDelta(3, "{}"),
    CallDone(3, "ping", "{}"),
    TextDelta(" after <tool_ca"),
]


def run(pieces: Sequence[str]) -> list[ToolCallEvent]:
    parser = JsonCallListParser("<tool_call>", "</tool_call>")
    events: list[ToolCallEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def test_whole_output() -> None:
    assert merged(run([OUTPUT])) == EXPECTED


def test_every_chunk_size_gives_the_same_events() -> None:
    for size in range(1, len(OUTPUT) + 1):
        pieces = [OUTPUT[i : i + size] for i in range(0, len(OUTPUT), size)]
        assert merged(run(pieces)) == EXPECTED, size


def test_every_two_piece_split_and_random_splits_give_the_same_events() -> None:
    for cut in range(len(OUTPUT) + 1):
        assert merged(run([OUTPUT[:cut], OUTPUT[cut:]])) == EXPECTED, cut
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), rng.randint(1, 30)))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)], strict=True)]
        assert merged(run(pieces)) == EXPECTED, cuts


def test_a_name_is_announced_as_soon_as_it_closes_and_arguments_stream() -> None:
    parser = JsonCallListParser("<tool_call>", "</tool_call>")
    assert parser.feed('<tool_call>[{"name": "get_wea') == []
    assert parser.feed('ther"') == [CallStarted(0, "get_weather")]
    assert parser.feed(', "arguments": {"ci') == [ArgumentsDelta(0, '{"ci')]
    assert parser.feed('ty": "P"}') == [ArgumentsDelta(0, 'ty": "P"}')]
    assert parser.feed("}") == [CallDone(0, "get_weather", '{"city": "P"}')]
    assert parser.feed("]</tool_call>") == []
    assert parser.finish() == []


def test_text_that_may_start_the_trigger_is_held_until_decided() -> None:
    parser = JsonCallListParser("<tool_call>", "</tool_call>")
    assert parser.feed("Use <tool") == [TextDelta("Use ")]
    assert parser.feed("s wisely") == [TextDelta("<tools wisely")]
    assert parser.feed(" <") == [TextDelta(" ")]
    assert parser.finish() == [TextDelta("<")]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        # the empty list: the model card's "no call"
        ("<tool_call>[]</tool_call>", []),
        # broken before any call: it was text after all
        ("<tool_call>not json", [TextDelta("<tool_call>not json")]),
        ('<tool_call>[{"name": 3}] ok', [TextDelta('<tool_call>[{"name": 3}] ok')]),
        # broken after a call: what was announced ends, the rest is text
        (
            '<tool_call>[{"name": "f", "arguments": {}}, oops',
            [CallStarted(0, "f"), ArgumentsDelta(0, "{}"), CallDone(0, "f", "{}"), TextDelta("oops")],
        ),
        # cut short (a length limit, a cancel): the open call ends incomplete
        (
            '<tool_call>[{"name": "f", "arguments": {"a": [1',
            [CallStarted(0, "f"), ArgumentsDelta(0, '{"a": [1'), CallDone(0, "f", '{"a": [1', complete=False)],
        ),
        # cut before the name closed: nothing was announced, so it is text
        ('<tool_call>[{"name": "f', [TextDelta('<tool_call>[{"name": "f')]),
        # a single object without the list
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
            [CallStarted(0, "f"), ArgumentsDelta(0, '{"a": 1}'), CallDone(0, "f", '{"a": 1}')],
        ),
        # two blocks: indices go on
        (
            '<tool_call>[{"name": "f", "arguments": {}}]</tool_call> and <tool_call>[{"name": "g", "arguments": {}}]'
            "</tool_call>",
            [
                CallStarted(0, "f"),
                ArgumentsDelta(0, "{}"),
                CallDone(0, "f", "{}"),
                TextDelta(" and "),
                CallStarted(1, "g"),
                ArgumentsDelta(1, "{}"),
                CallDone(1, "g", "{}"),
            ],
        ),
    ],
)
def test_unconstrained_output(output: str, expected: list[ToolCallEvent]) -> None:
    assert merged(run([output])) == expected
    assert merged(run(list(output))) == expected

"""Tool-call parsers on model output as real models emit it, in every chunking.

The property that matters to users: streaming gives exactly the non-streaming result, and
nothing a model writes makes the parser raise; what is not a valid call comes back as content.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator, Mapping

import pytest

from mlxcel.actors.toolcalls import (
    Event,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolFormat,
    collect,
    detect,
    make_parser,
    parse_complete,
)

H, L, M, P = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL, ToolFormat.PYTHONIC


def counter() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def complete(
    fmt: ToolFormat, text: str, tools: list[dict[str, object]] | None = None
) -> tuple[str | None, list[ToolCall]]:
    ids = counter()
    return parse_complete(fmt, text, new_id=lambda: next(ids), tools=tools)


def merged(events: list[Event]) -> list[Event]:
    """Adjacent TextDeltas joined: chunking may split content differently, nothing else."""
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, TextDelta) and out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def stream(
    fmt: ToolFormat, chunks: list[str], tools: list[dict[str, object]] | None = None
) -> list[Event]:
    ids = counter()
    parser = make_parser(fmt, new_id=lambda: next(ids), tools=tools)
    events: list[Event] = []
    for c in chunks:
        events += parser.feed(c)
    return events + parser.finish()


def chunkings(text: str) -> Iterator[list[str]]:
    """Every single split point, one character at a time, and seeded random splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(1234)
    for _ in range(25 if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def assert_chunking_invariant(
    fmt: ToolFormat, text: str, tools: list[dict[str, object]] | None = None
) -> list[Event]:
    whole = merged(stream(fmt, [text], tools))
    assert collect(whole) == complete(fmt, text, tools)
    for chunks in chunkings(text):
        assert merged(stream(fmt, chunks, tools)) == whole, chunks
    return whole


def call(i: int, name: str, args: Mapping[str, object]) -> ToolCall:
    return ToolCall(f"call_{i}", name, json.dumps(args, ensure_ascii=False))


WEATHER = {"city": "Paris"}

# (format, raw model output, expected content, expected calls)
VALID: list[tuple[ToolFormat, str, str | None, list[ToolCall]]] = [
    # Qwen2.5-7B-Instruct, one call
    (
        H,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [call(0, "get_weather", WEATHER)],
    ),
    # Qwen3 parallel calls, with the newline between blocks that it always emits
    (
        H,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "c"}}\n'
        "</tool_call>",
        None,
        [call(0, "get_weather", WEATHER), call(1, "get_weather", {"city": "Tokyo", "unit": "c"})],
    ),
    # text before the call; nested args whose strings hold braces, quotes and the close tag
    (
        H,
        "I'll write that file for you.\n\n<tool_call>\n"
        '{"name": "write_file", "arguments": {"path": "a.py", "content": '
        '"def f():\\n    return {\\"a\\": [1, 2]}  # } </tool_call>\\n", "opts": '
        '{"mode": 420, "tags": ["x", {"y": null}], "ok": true}}}\n</tool_call>',
        "I'll write that file for you.",
        [
            call(
                0,
                "write_file",
                {
                    "path": "a.py",
                    "content": 'def f():\n    return {"a": [1, 2]}  # } </tool_call>\n',
                    "opts": {"mode": 420, "tags": ["x", {"y": None}], "ok": True},
                },
            )
        ],
    ),
    # Hermes-2-Pro puts "arguments" before "name"; unicode stays unescaped
    (
        H,
        '<tool_call>\n{"arguments": {"symbol": "TSLA", "note": "café ☕"}, '
        '"name": "get_stock_fundamentals"}\n</tool_call>',
        None,
        [call(0, "get_stock_fundamentals", {"symbol": "TSLA", "note": "café ☕"})],
    ),
    # stopped right before the close tag (stop string or EOS): the JSON is whole, accept it
    (
        H,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        None,
        [call(0, "get_weather", WEATHER)],
    ),
    # Llama 3.1-8B-Instruct with <|python_tag|> kept
    (
        L,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [call(0, "get_weather", WEATHER)],
    ),
    # Llama 3.2-3B: bare JSON, "type" first, two calls separated by "; "
    (
        L,
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        None,
        [call(0, "get_weather", WEATHER), call(1, "get_time", {"tz": "Europe/Paris"})],
    ),
    # Llama 3.3 sometimes writes "arguments" and a leading newline
    (
        L,
        '\n{"name": "search", "arguments": {"q": "mlx {batching}", "k": 3}}\n',
        None,
        [call(0, "search", {"q": "mlx {batching}", "k": 3})],
    ),
    # Mistral-7B-Instruct-v0.3: a JSON list, with the model's own ids (ignored)
    (
        M,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
        '{"name": "get_time", "arguments": {}, "id": "f5G6h7I8j"}]',
        None,
        [call(0, "get_weather", WEATHER), call(1, "get_time", {})],
    ),
    # Mistral-Small-3.2 / Devstral: name[ARGS]{...}, repeated for parallel calls
    (
        M,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]read_file[ARGS]'
        '{"path": "src/[ARGS].py", "lines": [1, 20]}',
        None,
        [
            call(0, "get_weather", WEATHER),
            call(1, "read_file", {"path": "src/[ARGS].py", "lines": [1, 20]}),
        ],
    ),
    # later tokenizers add [CALL_ID]; text before the call
    (
        M,
        'Let me look.[TOOL_CALLS]get_weather[CALL_ID]x9Y8z7W6v[ARGS]{"city": "Paris"}',
        "Let me look.",
        [call(0, "get_weather", WEATHER)],
    ),
    # Llama 4 pythonic, nested and JSON-spelled literals, negative numbers, both quote styles
    (
        P,
        '[search(query=\'mlx "batching" ]\', filters={"year": [2023, 2024], "open": true, '
        '"near": (1.5, -2)}, limit=-5, fuzzy=None), get_time()]',
        None,
        [
            call(
                0,
                "search",
                {
                    "query": 'mlx "batching" ]',
                    "filters": {"year": [2023, 2024], "open": True, "near": [1.5, -2]},
                    "limit": -5,
                    "fuzzy": None,
                },
            ),
            call(1, "get_time", {}),
        ],
    ),
    (P, "[math.sqrt(x=2.0)]", None, [call(0, "math.sqrt", {"x": 2.0})]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), VALID)
def test_recorded_calls_parse_identically_in_every_chunking(
    fmt: ToolFormat, text: str, content: str | None, calls: list[ToolCall]
) -> None:
    assert complete(fmt, text) == (content, calls)
    events = assert_chunking_invariant(fmt, text)
    for c in calls:
        json.loads(c.arguments)  # every arguments string is valid JSON
    # OpenAI's delta shape: each index opens with its id and name, then arguments, then ends.
    tool_events = [e for e in events if not isinstance(e, TextDelta)]
    expected: list[Event] = []
    for i, c in enumerate(calls):
        expected += [ToolCallStart(i, c.id, c.name), ToolCallArgs(i, c.arguments), ToolCallEnd(i)]
    assert tool_events == expected


# Output that looks like (or starts like) a call but is not one: all of it is content.
MALFORMED: list[tuple[ToolFormat, str]] = [
    (H, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # max_tokens
    (H, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool>'),
    (H, "<tool_call>not json at all</tool_call> and then some"),
    (H, '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>'),
    (H, '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    (H, '<tool_call>{"arguments": {"x": 1}}</tool_call>'),  # no name
    (H, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),  # args not an object
    (H, '<tool_call>{"name": "f", "arguments": {"a": [1, 2}}</tool_call>'),  # bad bracket
    (H, "<tool_call>"),
    (L, '<|python_tag|>{"name": "get_weather", "parameters": {"city"'),
    (L, '<|python_tag|>brave_search.call(query="weather")'),  # a built-in tool, not JSON
    (L, '{"name": "Ada", "born": 1815}'),  # a JSON answer, not a call
    (L, "{ this is prose } with braces"),
    (M, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    (M, "[TOOL_CALLS] garbage here"),
    (M, '[TOOL_CALLS]get_weather[ARGS]"Paris"'),
    (M, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"'),
    (P, "[get_weather(city='Paris')"),
    (P, "[1] See the footnote."),
    (P, "[Note] this is prose (really)."),
    (P, "[get_weather('Paris')]"),  # positional: no argument name
    (P, '[__import__("os").system("echo pwned")]'),
    (P, '[f(x=__import__("os").getcwd())]'),
    (P, "[f(**kw)]"),
    (P, "[f(x=1e999)]"),  # inf has no JSON spelling
    (P, "[]"),
]


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_output_comes_back_as_content(fmt: ToolFormat, text: str) -> None:
    assert complete(fmt, text) == (text, [])
    assert_chunking_invariant(fmt, text)


def test_a_bad_call_after_a_good_one_keeps_the_good_one() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": </tool_call>'
    )
    content, calls = complete(H, text)
    assert calls == [call(0, "a", {})]
    assert content == '\n<tool_call>\n{"name": "b", "arguments": {"x": </tool_call>'
    assert_chunking_invariant(H, text)


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize(
    "text",
    [
        "Use the <tool> element, or <tool_call> tags, as the docs say.",
        "Tags like <|python_tag|> and [TOOL_CALLS] appear in docs; so does [f(x=1)].",
        'The answer is 42.\n\n{"name": "x", "parameters": {}}',  # JSON after prose
        "",
        "   \n",
    ],
)
def test_prose_without_calls_passes_through_exactly(fmt: ToolFormat, text: str) -> None:
    assert complete(fmt, text) == (text, [])
    assert_chunking_invariant(fmt, text)


def test_content_streams_at_once_holding_back_only_a_possible_marker() -> None:
    parser = make_parser(H)
    assert parser.feed("Hello") == [TextDelta("Hello")]
    assert parser.feed(" wor") == [TextDelta(" wor")]
    assert parser.feed("ld <to") == [TextDelta("ld")]  # " <to" might open <tool_call>
    assert parser.feed("ol> tag") == [TextDelta(" <tool> tag")]
    assert parser.finish() == []


def test_a_call_is_emitted_as_soon_as_it_closes() -> None:
    parser = make_parser(H, new_id=lambda: "call_x")
    parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call')
    assert parser.feed(">") == [
        ToolCallStart(0, "call_x", "f"),
        ToolCallArgs(0, '{"a": 1}'),
        ToolCallEnd(0),
    ]
    assert parser.finish() == []


def test_a_long_call_is_scanned_in_linear_time() -> None:
    big = json.dumps({"name": "write", "arguments": {"text": "{[(\"'" * 20000}})
    parser = make_parser(H, new_id=lambda: "c")
    events = parser.feed("<tool_call>")
    for i in range(0, len(big), 3):  # ~three characters a token
        events += parser.feed(big[i : i + 3])
    events += parser.feed("</tool_call>") + parser.finish()
    assert collect(events)[1][0].arguments == json.dumps(json.loads(big)["arguments"])


def test_default_ids_are_openai_style_and_unique() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 3
    ids = [c.id for c in parse_complete(H, text)[1]]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_mistral_ids_fit_mistral_templates() -> None:
    # Mistral templates reject a tool_call_id that is not 9 alphanumerics on the next turn.
    _, calls = parse_complete(M, '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"a": 1}')
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)


QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n\\nYou may call one or more functions"
    " to assist with the user query.\\n\\n<tools>{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}</tools>\\n\\nFor each function call, return a json object with function name"
    ' and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)
LLAMA31_TEMPLATE = (
    "{%- if builtin_tools is defined or tools is not none %}{{- 'Environment: ipython\\n' }}"
    '{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of '
    'argument name and its value}." }}{{- "<|python_tag|>" + tool_call.name }}'
)
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}{%- for tool_call in x %}"
PYTHONIC_TEMPLATE = (
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
)
SMOLLM2_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "vocab", "expected"),
    [
        (QWEN_TEMPLATE, {"<tool_call>": 151657}, H),
        (LLAMA31_TEMPLATE, {"<|python_tag|>": 128010}, L),
        (MISTRAL_TEMPLATE, {"[TOOL_CALLS]": 5}, M),
        (PYTHONIC_TEMPLATE, {"<|python_start|>": 200016}, P),
        (SMOLLM2_TEMPLATE, {"<|im_start|>": 1}, None),
        (None, None, None),
        (None, {"[TOOL_CALLS]": 5}, M),  # no template: the special token decides
        (SMOLLM2_TEMPLATE, {"<tool_call>": 151657}, H),
    ],
)
def test_detect_from_template_then_vocab(
    template: str | None, vocab: dict[str, int] | None, expected: ToolFormat | None
) -> None:
    assert detect(template, vocab) is expected


PIECES = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
    '{"name": "f", "arguments": ', '{"name": "g", "parameters": {"a": [1, "}"]}}', "{", "}",
    "[", "]", "(", ")", '"', "'", "\\", "f(x=1)", "; ", "\n", " ", "text", "<", "<tool", "[TOOL",
    "<function=f>", "</function>", "<parameter=a>", "</parameter>", "f\n", "<arg_key>", "a",
    "</arg_key>", "<arg_value>", "</arg_value>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|tool_calls_section_end|>", "{}",
]  # fmt: skip


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_random_marker_soup_never_raises_and_matches_complete(fmt: ToolFormat) -> None:
    rng = random.Random(7)
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        content, calls = complete(fmt, text)
        whole = merged(stream(fmt, [text]))
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 5)))
            chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
            assert merged(stream(fmt, chunks)) == whole, text
        if not calls:
            assert content == text  # nothing is lost when nothing is a call


G = ToolFormat.GENERIC


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', None,
         [call(0, "get_weather", WEATHER)]),
        ('{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "}"}}]}',
         None, [call(0, "a", {}), call(1, "b", {"x": "}"})]),
        ('{"response": "Hi \\"you\\"\\n\\u00e9 \\ud83d\\ude00"}', 'Hi "you"\né 😀', []),
        ('{"response": {"a": 1}}', '{"a": 1}', []),  # a response_format schema's value
        # Cut off by max_tokens, or not the generic shape: the raw text is the answer.
        ('{"tool_call": {"name": "a", "argu', '{"tool_call": {"name": "a", "argu', []),
        ('{"other": 1}', '{"other": 1}', []),
    ],
)  # fmt: skip
def test_generic_format(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert complete(G, text) == (content, calls)
    assert_chunking_invariant(G, text)


def test_generic_response_streams_while_it_is_decoded() -> None:
    parser = make_parser(G)
    assert parser.feed('{"response": "Hel') == [TextDelta("Hel")]
    assert parser.feed("lo \\") == [TextDelta("lo ")]  # the escape waits for its character
    assert parser.feed('n"}') == [TextDelta("\n")]
    assert parser.finish() == []


G, D, K = ToolFormat.GENERIC, ToolFormat.DEEPSEEK_V31, ToolFormat.KIMI_K2
KIMI = "<|tool_calls_section_begin|><|tool_call_begin|>functions."

CUT: list[tuple[ToolFormat, str, list[Event]]] = [
    # max_tokens inside the arguments: the call as far as it got, no raw wrapper as content
    (
        G,
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Os',
        [ToolCallStart(0, "call_0", "get_weather"), ToolCallArgs(0, '{"city": "Os')],
    ),
    # parallel: the whole calls, then the cut one
    (
        G,
        '{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {',
        [
            ToolCallStart(0, "call_0", "now"),
            ToolCallArgs(0, "{}"),
            ToolCallEnd(0),
            ToolCallStart(1, "call_1", "get_weather"),
            ToolCallArgs(1, "{"),
        ],
    ),
    # cut before the name is whole: nothing to show, and no wrapper text either
    (G, '{"tool_calls": [{"na', []),
    (G, '{"tool_c', []),
    # a reply cut by the budget is the reply so far
    (G, '{"response": "Hello wor', [TextDelta("Hello wor")]),
    (
        H,
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
        [
            TextDelta("Sure."),
            ToolCallStart(0, "call_0", "get_weather"),
            ToolCallArgs(0, '{"city": "Os'),
        ],
    ),
    (H, '<tool_call>\n{"name": "get_wea', []),
    (
        L,
        '{"name": "get_weather", "parameters": {"city": "Os',
        [ToolCallStart(0, "call_0", "get_weather"), ToolCallArgs(0, '{"city": "Os')],
    ),
    # bare JSON that never became a call stays content
    (L, '{"nam', [TextDelta('{"nam')]),
    (
        K,
        KIMI + "now:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions."
        'get_weather:1<|tool_call_argument_begin|>{"city": "Os',
        [
            ToolCallStart(0, "call_0", "now"),
            ToolCallArgs(0, "{}"),
            ToolCallEnd(0),
            ToolCallStart(1, "call_1", "get_weather"),
            ToolCallArgs(1, '{"city": "Os'),
        ],
    ),
    # raw-text arguments: the cut call is left out, and none of its markup is content
    (
        ToolFormat.QWEN3_CODER,
        "Checking.<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days",
        [TextDelta("Checking.")],
    ),
    # arguments whole, only the call's end marker cut: a whole call
    (
        D,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}",
        [ToolCallStart(0, "call_0", "now"), ToolCallArgs(0, "{}"), ToolCallEnd(0)],
    ),
]


@pytest.mark.parametrize(("fmt", "text", "events"), CUT)
def test_a_call_cut_by_the_budget_ends_as_a_partial_call(
    fmt: ToolFormat, text: str, events: list[Event]
) -> None:
    for size in (1, 3, len(text)):
        parser = make_parser(fmt, new_id=counter().__next__)
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        out = [ev for chunk in chunks for ev in parser.feed(chunk)] + parser.finish(cut=True)
        assert merged(out) == events

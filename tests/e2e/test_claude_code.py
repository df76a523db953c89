"""Claude Code as a client: a scripted session with the `anthropic` SDK sending what that client
sends, against the embedded default model (SmolLM2-135M-Instruct, text only, no thinking, the
generic tool format).

Claude Code's requests: the beta route (`/v1/messages?beta=true` with `anthropic-beta`
flags), about fifteen tools with JSON Schema draft-07 inputs, `tool_choice` auto, `thinking`
enabled, `system` as text blocks with `cache_control`, `metadata.user_id`, `count_tokens` before
each turn, every turn streamed, the assistant's `tool_use` blocks sent back with their
`tool_result`s, and screenshots (image blocks) inside tool results.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.conftest import ServerProcess

DRAFT7 = "http://json-schema.org/draft-07/schema#"


def tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> Any:
    schema = {"type": "object", "properties": props, "required": required,
              "additionalProperties": False, "$schema": DRAFT7}  # fmt: skip
    return {"name": name, "description": description, "input_schema": schema}


S, N, B = {"type": "string"}, {"type": "number"}, {"type": "boolean"}
TOOLS: list[Any] = [
    tool("Bash", "Executes a given bash command in a persistent shell session.",
         {"command": {**S, "description": "The command to execute"},
          "timeout": {**N, "description": "Optional timeout in milliseconds (max 600000)"},
          "description": {**S, "description": "Clear, concise description of what this does"},
          "run_in_background": {**B, "description": "Run this command in the background"}},
         ["command"]),
    tool("Glob", "Fast file pattern matching tool that works with any codebase size.",
         {"pattern": {**S, "description": "The glob pattern to match files against"},
          "path": {**S, "description": "The directory to search in"}}, ["pattern"]),
    tool("Grep", "A powerful search tool built on ripgrep.",
         {"pattern": {**S, "description": "The regular expression pattern to search for"},
          "path": S, "glob": S,
          "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
          "-i": B, "-n": B, "head_limit": N}, ["pattern"]),
    tool("Read", "Reads a file from the local filesystem. Images are shown visually.",
         {"file_path": {**S, "description": "The absolute path to the file to read"},
          "offset": N, "limit": N}, ["file_path"]),
    tool("Edit", "Performs exact string replacements in files.",
         {"file_path": S, "old_string": S, "new_string": S, "replace_all": B},
         ["file_path", "old_string", "new_string"]),
    tool("MultiEdit", "Makes multiple edits to a single file in one operation.",
         {"file_path": S, "edits": {"type": "array", "minItems": 1, "items": {
             "type": "object", "additionalProperties": False,
             "properties": {"old_string": S, "new_string": S, "replace_all": B},
             "required": ["old_string", "new_string"]}}}, ["file_path", "edits"]),
    tool("Write", "Writes a file to the local filesystem.",
         {"file_path": S, "content": S}, ["file_path", "content"]),
    tool("NotebookEdit", "Replaces the contents of a cell in a Jupyter notebook.",
         {"notebook_path": S, "cell_id": S, "new_source": S,
          "cell_type": {"type": "string", "enum": ["code", "markdown"]},
          "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
         ["notebook_path", "new_source"]),
    tool("WebFetch", "Fetches content from a specified URL and processes it.",
         {"url": {**S, "format": "uri"}, "prompt": S}, ["url", "prompt"]),
    tool("WebSearch", "Searches the web and uses the results to inform responses.",
         {"query": {**S, "minLength": 2},
          "allowed_domains": {"type": "array", "items": S},
          "blocked_domains": {"type": "array", "items": S}}, ["query"]),
    tool("TodoWrite", "Create and manage a structured task list for the session.",
         {"todos": {"type": "array", "items": {
             "type": "object", "additionalProperties": False,
             "properties": {"content": {**S, "minLength": 1},
                            "status": {"type": "string",
                                       "enum": ["pending", "in_progress", "completed"]},
                            "activeForm": {**S, "minLength": 1}},
             "required": ["content", "status", "activeForm"]}}}, ["todos"]),
    tool("Task", "Launch a new agent to handle complex, multi-step tasks autonomously.",
         {"description": S, "prompt": S, "subagent_type": S},
         ["description", "prompt", "subagent_type"]),
    tool("BashOutput", "Retrieves output from a running or completed background bash shell.",
         {"bash_id": S, "filter": S}, ["bash_id"]),
    tool("KillShell", "Kills a running background bash shell by its ID.",
         {"shell_id": S}, ["shell_id"]),
    tool("ExitPlanMode", "Prompts the user to exit plan mode and start coding.",
         {"plan": S}, ["plan"]),
]  # fmt: skip
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM: list[Any] = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "cache_control": {"type": "ephemeral"},
     "text": "You are an interactive CLI tool that helps users with software engineering "
             "tasks. Use the tools available to you. Be concise.\n\n<env>\nWorking directory: "
             "/home/user/project\nPlatform: linux\n</env>"},
]  # fmt: skip
BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
]
# A 1x1 PNG, as the Read tool returns a screenshot.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAF"
    "BQIAX8jx0gAAAABJRU5ErkJggg=="
)
RESULTS = {
    "Bash": "README.md\nscreenshot.png\nsrc\ntests",
    "Glob": "/home/user/project/src/main.py\n/home/user/project/src/util.py",
    "Grep": "src/main.py:3:def main():",
}


@pytest.fixture(scope="module")
def claude() -> Iterator[anthropic.Anthropic]:
    server = ServerProcess([])
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="x", max_retries=0, timeout=300
    ) as c:
        yield c
    server.stop()


def result_for(use: Any, turn: int) -> dict[str, Any]:
    """What Claude Code sends back for a call; from the second turn on, a screenshot too."""
    content: list[Any] = [{"type": "text", "text": RESULTS.get(use.name, "Done.")}]
    if turn >= 1:
        image = {"type": "base64", "media_type": "image/png", "data": PNG}
        content.append({"type": "image", "source": image})
    return {"type": "tool_result", "tool_use_id": use.id, "content": content}


def check_events(events: list[Any]) -> None:
    """The stream as a strict client reads it: message_start first, one block open at a time
    with indices 0, 1, ..., then message_delta and message_stop."""
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    index, open_block = -1, False
    for e in events:
        if e.type == "content_block_start":
            assert not open_block and e.index == index + 1
            index, open_block = e.index, True
        elif e.type == "content_block_delta":
            assert open_block and e.index == index
        elif e.type == "content_block_stop":
            assert open_block and e.index == index
            open_block = False
    assert not open_block


def test_a_claude_code_session_runs_end_to_end(claude: anthropic.Anthropic) -> None:
    messages: list[Any] = [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nThis is a reminder.\n</system-reminder>"},
            {"type": "text", "text": "Run ls to list the files in this project.",
             "cache_control": {"type": "ephemeral"}},
        ]},
    ]  # fmt: skip
    common: dict[str, Any] = {
        "model": "default",
        "system": SYSTEM,
        "tools": TOOLS,
        "betas": BETAS,
        # On a model that does not think this is accepted and changes nothing: no thinking
        # blocks come back (docs/reference/http-api.md).
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    calls = images_sent = 0
    for turn in range(4):
        counted = claude.beta.messages.count_tokens(**common, messages=messages)
        with claude.beta.messages.stream(
            **common,
            messages=messages,
            max_tokens=32000,
            tool_choice={"type": "auto"},
            metadata={"user_id": "user_abc_account__session_1"},
            extra_body={"temperature": 0},
        ) as stream:
            events = list(stream)
            message = stream.get_final_message()
        check_events(events)
        start = events[0].message.usage
        # count_tokens is the whole prompt the next message reads: Anthropic splits it into
        # uncached and cached input.
        prompt = start.input_tokens + (start.cache_read_input_tokens or 0)
        assert counted.input_tokens == prompt, turn
        assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == prompt
        assert message.usage.output_tokens > 0
        assert not [b for b in message.content if b.type in ("thinking", "redacted_thinking")]
        uses = [b for b in message.content if b.type == "tool_use"]
        if message.stop_reason == "tool_use":
            assert uses
            for use in uses:
                assert use.id.startswith("toolu_")
                streamed = "".join(
                    e.delta.partial_json
                    for e in events
                    if e.type == "content_block_delta"
                    and e.delta.type == "input_json_delta"
                    and message.content[e.index] is use
                )
                assert json.loads(streamed) == use.input
                jsonschema.validate(use.input, SCHEMAS[use.name])
            calls += len(uses)
            results = [result_for(use, turn) for use in uses]
            images_sent += sum(len(r["content"]) - 1 for r in results)
            messages += [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": results}]  # fmt: skip
        else:
            assert message.stop_reason in ("end_turn", "max_tokens") and not uses
            assert [b.type for b in message.content] == ["text"]
            messages += [
                {"role": "assistant", "content": message.content},
                {"role": "user", "content": "Now read screenshot.png with the Read tool."},
            ]
    # The session did what an agent does: called tools and read results with screenshots.
    assert calls >= 2 and images_sent >= 1


def test_a_screenshot_in_a_tool_result_is_a_note_and_a_bad_one_a_400(
    claude: anthropic.Anthropic,
) -> None:
    """A text model reads a tool result's image as a note saying it is not shown (a 400 would
    end the session: the image stays in the history); a malformed image is still a 400 naming
    the block, and an image the user sends in their own turn is refused as before."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read",
           "input": {"file_path": "/home/user/project/screenshot.png"}}  # fmt: skip

    def turn(result: list[Any]) -> list[Any]:
        return [
            {"role": "user", "content": "Look at the screenshot."},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
        ]  # fmt: skip

    text = {"type": "text", "text": "Screenshot of the login page"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}  # fmt: skip
    alone, with_image = (
        claude.messages.count_tokens(model="default", tools=TOOLS, messages=turn(r))
        for r in ([text], [text, image])
    )
    assert with_image.input_tokens > alone.input_tokens  # the note is in the prompt
    answer = claude.messages.create(
        model="default", max_tokens=8, tools=TOOLS, messages=turn([text, image])
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")

    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="default", max_tokens=8, messages=turn([broken]))
    assert "messages[2].content[0].content[0].source" in str(bad.value)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert "image input is not supported" in str(refused.value)

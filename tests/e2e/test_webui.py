"""The chat page at `/`, used in a real browser: Debian's Chromium (headless), driven by
Playwright for Python, against `mlxcel serve` with the embedded default model.

Talk mode hears a question spoken by the Piper voice through Chromium's fake microphone. The
run takes the screenshots of the chat and talk views (docs/images/, see ``shot``)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import REPO, ServerProcess
from tests.support.metrics import sample, wait_for
from tests.support.realtime import silence, spoken

IMAGES = REPO / "docs" / "images"
KEY = "open-sesame"
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]


def chromium() -> str:
    """The Chromium the tests drive: ``MLXCEL_CHROMIUM`` when set, else the one on PATH
    (Debian's, which tools/setup.sh installs wherever apt exists). Missing is a failure that
    says how to get one, never a skip that would count as a pass."""
    found = (
        os.environ.get("MLXCEL_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )
    if found:
        return found
    pytest.fail(
        "no Chromium for the chat page's tests: run tools/setup.sh (apt-get install chromium), "
        "or point MLXCEL_CHROMIUM at a Chromium or Chrome binary"
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(["--parallel", "2", "--metrics"])
    yield s
    s.stop()


def write_wav(path: Path, *parts: np.ndarray) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(np.concatenate(parts).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    executable = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:

        def launch(microphone: Path) -> Any:
            # The fake microphone plays the file once (%noloop), then silence.
            fake_mic = f"--use-file-for-fake-audio-capture={microphone}%noloop"
            return p.chromium.launch(executable_path=executable, args=[*BROWSER_ARGS, fake_mic])

        yield launch


@pytest.fixture(scope="module")
def browser(playwright: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Its microphone says the question, then stays silent long enough for the answer."""
    wav = tmp_path_factory.mktemp("audio") / "question.wav"
    b = playwright(write_wav(wav, silence(0.5), spoken(), silence(8.0)))
    yield b
    b.close()


@contextlib.contextmanager
def browsing(browser: Any) -> Iterator[Any]:
    """A fresh profile (empty storage); uncaught errors and CSP violations fail the test."""
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    p = context.new_page()
    problems: list[str] = []
    p.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    p.on(
        "console",
        lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None,
    )
    yield p
    context.close()
    assert not problems


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    with browsing(browser) as p:
        yield p


def until(check: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    """Poll ``check`` (the page's CSP forbids Playwright's string predicates)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def shot(page: Any, name: str) -> None:
    """Every run takes the screenshot; it replaces the one in docs/images/ only when that is
    missing or ``MLXCEL_UPDATE_SCREENSHOTS=1`` (its speed figures and the talk answer differ
    from run to run, so a plain test run leaves the checkout clean)."""
    target = IMAGES / name
    if target.exists() and os.environ.get("MLXCEL_UPDATE_SCREENSHOTS") != "1":
        target = Path(tempfile.gettempdir()) / f"mlxcel-{name}"
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target))
    assert target.stat().st_size > 10_000  # a rendered view, not a blank page


def open_page(page: Any, base_url: str) -> None:
    page.goto(base_url + "/")
    page.wait_for_selector("body[data-ready=true]", state="attached")


def settings(page: Any, **values: object) -> None:
    page.click("#settings-button")
    for name, value in values.items():
        page.fill(f"#set-{name}", str(value))
        page.dispatch_event(f"#set-{name}", "change")
    page.click("#settings-button")


def ask(page: Any, question: str) -> None:
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    page.wait_for_selector("body[data-state=streaming]", state="attached")


def idle(page: Any) -> None:
    page.wait_for_selector("body[data-state=idle]", state="attached", timeout=120_000)


def test_json_clients_keep_the_status_and_browsers_get_the_page(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/").json() == {"status": "ok"}
    r = httpx.get(server.base_url + "/", headers={"Accept": "application/json"})
    assert r.json() == {"status": "ok"}
    assert "Accept" in r.headers["vary"]
    navigation = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    r = httpx.get(server.base_url + "/", headers={"Accept": navigation, "Accept-Encoding": "gzip"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'sha256-" in r.headers["content-security-policy"]
    # One self-contained document (no CDN, no second request), small for a fast cold load.
    assert r.headers["content-encoding"] == "gzip"
    assert int(r.headers["content-length"]) < 20_000
    assert len(r.content) < 80_000
    assert not re.search(r"(src|href)=\"?https?:", r.text)
    again = httpx.get(
        server.base_url + "/", headers={"Accept": navigation, "If-None-Match": r.headers["etag"]}
    )
    assert again.status_code == 304


def test_typed_question_streams_an_answer_kept_in_the_browser(
    page: Any, server: ServerProcess
) -> None:
    open_page(page, server.base_url)
    assert page.input_value("#model") == "SmolLM2-135M-Instruct"
    # The speech models /v1/models lists beside it are not offered for chat.
    options = page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
    assert options == ["SmolLM2-135M-Instruct"]
    # Greedy: the same answer (and screenshot) every run.
    settings(page, max_tokens=48, temperature=0)
    ask(page, "Write a Python function that adds two numbers.")
    # Words appear while the answer is still streaming (48 tokens take seconds here).
    until(lambda: bool(page.inner_text(".msg.assistant .body").strip()), "the first words")
    assert page.get_attribute("body", "data-state") == "streaming"
    assert page.is_visible("#stop") and not page.is_visible("#send")
    idle(page)
    answer = page.inner_text(".msg.assistant .body")
    assert answer.strip()
    assert "tok/s" in page.inner_text(".msg.assistant .stats")
    shot(page, "webui-chat.png")

    page.click(".msg.assistant .regenerate")
    idle(page)
    assert page.locator(".msg.assistant").count() == 1
    assert page.inner_text(".msg.assistant .body").strip()

    # Reloaded, the conversation is still there (the browser's storage keeps it).
    page.reload()
    page.wait_for_selector("body[data-ready=true]", state="attached")
    title = "Write a Python function that adds two numbers."
    page.click(f"#conversations li span[title='{title}']")
    assert page.locator(".msg.user .body").inner_text() == title
    assert page.locator(".msg.assistant").count() == 1


def test_edit_turn_asks_again(page: Any, server: ServerProcess) -> None:
    open_page(page, server.base_url)
    settings(page, max_tokens=8)
    ask(page, "Say hello.")
    idle(page)
    page.click(".msg.user .edit")
    page.fill(".msg.user textarea", "Say goodbye.")
    page.click(".msg.user .actions button:text('Save & send')")
    page.wait_for_selector("body[data-state=streaming]", state="attached")
    idle(page)
    assert page.inner_text(".msg.user .body") == "Say goodbye."
    assert page.locator(".msg").count() == 2


def test_stop_aborts_the_request_on_the_server(page: Any, server: ServerProcess) -> None:
    open_page(page, server.base_url)
    settings(page, max_tokens=4000)
    before = sample(server.base_url, "mlxcel_aborts_total") or 0.0
    ask(page, "Tell me a very long story about a dragon and a knight.")
    until(lambda: len(page.inner_text(".msg.assistant .body")) > 20, "some of the story")
    page.click("#stop")
    idle(page)
    # The fetch was aborted, so the server cancelled the row.
    wait_for(server.base_url, "mlxcel_aborts_total", lambda v: v >= before + 1)
    assert "stopped" in page.inner_text(".msg.assistant .stats")


def test_image_attach_once_the_model_reads_images(page: Any, server: ServerProcess) -> None:
    open_page(page, server.base_url)
    assert not page.is_visible("#attach")  # SmolLM2 reads text only
    # A vision model's /props, and its answer, stand in for one here.
    props = httpx.get(server.base_url + "/props").json()
    props["modalities"]["vision"] = True
    page.route("**/props", lambda route: route.fulfill(json=props))
    sent: list[dict[str, Any]] = []

    def answer(route: Any) -> None:
        sent.append(json.loads(route.request.post_data))
        chunk = {"choices": [{"index": 0, "delta": {"content": "A red square."}}]}
        route.fulfill(
            body=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n",
            headers={"Content-Type": "text/event-stream"},
        )

    page.route("**/v1/chat/completions", answer)
    page.reload()
    page.wait_for_selector("body[data-ready=true]", state="attached")
    assert page.is_visible("#attach")
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    )
    image = {"name": "red.png", "mimeType": "image/png", "buffer": png}
    page.set_input_files("#image-input", image)
    page.wait_for_selector("#attachments img")
    page.fill("#prompt", "What is this?")
    page.press("#prompt", "Enter")
    until(lambda: page.inner_text(".msg.assistant .body") == "A red square.", "the answer")
    idle(page)
    parts = sent[0]["messages"][-1]["content"]
    assert parts[0]["type"] == "image_url"
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[1] == {"type": "text", "text": "What is this?"}
    assert page.locator(".msg.user .body img").count() == 1


def test_streamed_reasoning_tool_calls_and_speed_are_shown(
    page: Any, server: ServerProcess
) -> None:
    # SmolLM2 neither reasons nor calls tools: a stream shaped as ours are stands in for one.
    def delta(**d: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": d}]}

    chunks = [
        delta(role="assistant", content=""),
        delta(reasoning_content="The user wants "),
        delta(reasoning_content="the weather."),
        delta(tool_calls=[{"index": 0, "function": {"name": "get_weather", "arguments": ""}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
        {
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
            "timings": {"predicted_n": 12, "predicted_per_second": 42.5},
        },
    ]
    # A keep-alive comment between events, as the server sends while a prompt is read.
    body = ": ping\n\n" + "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            body=body + "data: [DONE]\n\n", headers={"Content-Type": "text/event-stream"}
        ),
    )
    open_page(page, server.base_url)
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .tool-call")
    idle(page)
    reasoning = page.locator(".msg.assistant details.reasoning")
    # Collapsed, apart from the answer, until asked for.
    assert reasoning.inner_text() == "Reasoning"
    reasoning.locator("summary").click()
    assert reasoning.inner_text().endswith("The user wants the weather.")
    assert page.inner_text(".tool-call") == '\u2192 get_weather({"city": "Paris"})'
    assert page.inner_text(".msg.assistant .stats") == "12 tokens \u00b7 42.5 tok/s"


def test_untrusted_answers_render_as_markdown_without_markup(
    page: Any, server: ServerProcess
) -> None:
    hostile = (
        "# Title\n<img src=x onerror=\"document.title='pwned'\">\n"
        "**bold** and [a link](javascript:alert(1)) and [ok](https://example.org)\n\n"
        "```python\ndef f(x):  # note\n    return x + 1\n```\n"
    )
    conversation = {
        "id": "c1",
        "title": "Stored",
        "updated": 1,
        "messages": [
            {"role": "user", "content": "<b>not bold</b>"},
            {
                "role": "assistant",
                "content": hostile,
                "reasoning": "Thinking it over.",
                "toolCalls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
            },
        ],
    }
    open_page(page, server.base_url)
    page.evaluate(
        "c => localStorage.setItem('mlxcel.conversations', JSON.stringify([c]))", conversation
    )
    page.reload()
    page.click("#conversations li span[title='Stored']")
    body = page.locator(".msg.assistant .body")
    assert body.locator("h1").inner_text() == "Title"
    assert body.locator("strong").inner_text() == "bold"
    assert body.locator("img").count() == 0 and "<img src=x" in body.inner_text()
    hrefs = [a.get_attribute("href") for a in body.locator("a").all()]
    assert hrefs == ["https://example.org"]
    assert body.locator("pre code .hl-k").first.inner_text() == "def"
    assert body.locator("pre code .hl-c").inner_text() == "# note"
    assert page.locator(".msg.user .body b").count() == 0
    assert page.locator("details.reasoning summary").inner_text() == "Reasoning"
    assert "get_weather" in page.inner_text(".tool-call")
    assert page.title() == "mlxcel"


def test_talk_mode_hears_the_question_and_plays_the_answer(
    page: Any, server: ServerProcess
) -> None:
    open_page(page, server.base_url)
    settings(page, max_tokens=24)  # the answer's limit in talk mode too
    page.click("#talk-button")
    page.wait_for_selector("#talk-log .line.user", timeout=120_000)
    until(
        lambda: "capital" in page.inner_text("#talk-log .line.user").lower(),
        "the transcript",
        120,
    )
    # Read at the device's rate (Chromium's fake one: 44.1 kHz) and resampled to 24 kHz by
    # the page's worklet: the transcript above is what checks the resampling.
    assert int(page.get_attribute("#talk", "data-mic-rate")) >= 8000
    heard = page.inner_text("#talk-log .line.user").lower()
    assert "france" in heard
    until(lambda: int(page.get_attribute("#talk", "data-played-bytes")) > 0, "answer audio", 120)
    page.wait_for_selector("#talk[data-state=listening]", state="attached", timeout=120_000)
    assert page.inner_text("#talk-log .line.assistant").strip()
    # 24 kHz PCM16: a spoken answer is at least a fraction of a second.
    assert int(page.get_attribute("#talk", "data-played-bytes")) > 24_000
    shot(page, "webui-talk.png")
    page.click("#talk-end")
    page.wait_for_selector("#messages .msg.user", timeout=10_000)
    assert "france" in page.inner_text("#messages .msg.user .body").lower()


def test_talking_over_the_answer_cuts_it_off(
    playwright: Any, server: ServerProcess, tmp_path: Path
) -> None:
    # A question with a long answer, then the user talks over it with another question.
    wav = write_wav(
        tmp_path / "barge-in.wav",
        silence(0.5),
        spoken("Tell me a long story about a dragon."),
        silence(3.0),
        spoken(),
        silence(10.0),
    )
    browser = playwright(wav)
    try:
        with browsing(browser) as page:
            open_page(page, server.base_url)
            # A long answer every time (greedy, told to go on): a short one could end, and
            # stop playing, before the second question starts.
            settings(
                page,
                max_tokens=200,
                temperature=0,
                system="You are a storyteller. Always tell long stories with many details.",
            )
            page.click("#talk-button")
            page.wait_for_selector(
                "#talk-log .line.assistant.cancelled", state="attached", timeout=120_000
            )
            # The answer was playing: the page dropped what it still had queued.
            assert int(page.get_attribute("#talk", "data-cut-off")) >= 1
            until(
                lambda: "france" in page.inner_text("#talk-log").lower(),
                "the second question",
                120,
            )
            page.wait_for_selector(
                "#talk-log .line.user + .line.assistant:not(.cancelled)",
                state="attached",
                timeout=120_000,
            )
    finally:
        browser.close()


@pytest.fixture(scope="module")
def key_server() -> Iterator[ServerProcess]:
    # Under a prefix too: the page at / calls /api/... (and /api/v1/realtime).
    s = ServerProcess(["--parallel", "1", "--api-key", KEY, "-n", "16", "--api-prefix", "/api"])
    yield s
    s.stop()


def test_key_protected_server_asks_for_the_key(page: Any, key_server: ServerProcess) -> None:
    page.goto(key_server.base_url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-error:not([hidden])")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("body[data-ready=true]", state="attached")
    ask(page, "Hello!")
    idle(page)
    assert page.inner_text(".msg.assistant .body").strip()
    assert not page.locator(".msg.assistant .error").count()
    # Kept in the browser: a reload does not ask again.
    page.reload()
    page.wait_for_selector("body[data-ready=true]", state="attached")
    assert not page.locator("#key-dialog[open]").count()
    # The realtime socket takes the key as a subprotocol (a browser cannot send headers).
    page.click("#talk-button")
    page.wait_for_selector("#talk[data-state=listening]", state="attached", timeout=60_000)
    page.click("#talk-end")


def test_no_webui_keeps_the_json_status() -> None:
    s = ServerProcess(["--no-webui", "--no-audio"])
    try:
        r = httpx.get(s.base_url + "/", headers={"Accept": "text/html"})
        assert r.status_code == 200
        assert json.loads(r.text) == {"status": "ok"}
    finally:
        s.stop()

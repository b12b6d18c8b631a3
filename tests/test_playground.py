"""The playground page in headless Chromium (playwright): compare mode, rendered math, the knobs, stop."""

import json
import time

import httpx
import pytest
from conftest import assert_idle_soon

from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app


class SlowRandom(RandomPolicy):
    """Random routing that takes 20 ms a token, so a stream lasts long enough to be stopped mid-way."""

    def route(self, *args, **kwargs):
        time.sleep(0.02)
        return super().route(*args, **kwargs)


@pytest.fixture(scope="module")
def server(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, SlowRandom(0.5, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_tokens=400, context_length=512))
    with BackgroundServer(app) as srv:
        yield srv.url


@pytest.fixture
def page(browser, server):
    context = browser.new_context()
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    page.wait_for_function("document.getElementById('pair').textContent !== ''")  # server info loaded
    yield page
    context.close()
    assert not errors, errors


def ask(page, question: str, max_tokens: int) -> None:
    page.fill("#maxTokens", str(max_tokens))
    page.fill("#question", question)
    page.press("#question", "Enter")  # the keyboard submits


def test_compare_mode_streams_into_every_pane_with_its_stats(page, tmp_path):
    page.check("#compare")
    assert page.locator(".pane").count() == 3
    assert "one after another" in page.text_content("#note")
    ask(page, "What is 48 / 2?", 24)
    page.wait_for_function("[...document.querySelectorAll('.pane .status')].every(s => "
                           "s.textContent.startsWith('finished in'))", timeout=60000)
    for system in ("slm", "r2r", "llm"):
        pane = page.locator(f'.pane[data-system="{system}"]')
        stats = pane.locator(".stats").text_content()
        raw = pane.locator(".raw span")
        assert raw.count() >= 1 and f"{raw.count()} tokens" in stats, stats  # up to 24: a model may stop early
        assert "tok/s" in stats and "LLM share" in stats and "first token" in stats, stats
        routed = pane.locator(".raw span.llm").count()
        if system == "slm":
            assert routed == 0 and "LLM share 0.0%" in stats
        elif system == "llm":
            assert routed == raw.count() and "LLM share 100.0%" in stats
        else:
            assert 0 < routed < raw.count()  # random routing at 0.5 over 24 tokens
            assert "router score" in pane.locator(".raw span").first.get_attribute("title")
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
    page.uncheck("#withSlm")  # two panes: R2R against the LLM alone
    assert [page.get_attribute(f".pane:nth-child({i})", "data-system") for i in (1, 2)] == ["r2r", "llm"]
    assert page.locator(".pane").count() == 2


def sse(*pieces: tuple[str, str]) -> str:
    """A chat stream as the server sends it: one chunk per token with its provenance."""
    chunks = [{"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
               "r2r": {"token_id": i, "source": source, "score": 0.9 if source == "llm" else 0.1}}
              for i, (text, source) in enumerate(pieces)]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markdown_math_and_code_render_with_routed_tokens_marked(page):
    answer = sse(("The **average", "slm"), (" speed**", "llm"), (" is", "slm"), (" \\(", "slm"), ("\\frac", "llm"),
                 ("{300}{5}", "slm"), (" = 60", "slm"), ("\\)", "slm"), (" km/h", "fix"), (".\n\n", "slm"),
                 ("```python\n", "slm"), ("print", "slm"), ("(300 / 5)", "llm"), ("\n```\n", "slm"),
                 ("<img src=x onerror=alert(1)>", "slm"), (" Costs $2 and $3.", "slm"))
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=answer))
    ask(page, "How fast?", 32)
    page.wait_for_function("document.querySelector('.pane .status').textContent.startsWith('finished in')")
    rendered = page.locator(".pane .rendered")
    assert rendered.locator(".katex").count() == 1  # \( \frac{300}{5} = 60 \) became math
    assert rendered.locator(".katex-html .mfrac").count() == 1  # typeset as a fraction, not shown as TeX
    assert rendered.locator(".math.routed .katex").count() == 1  # the formula holds an LLM token
    assert rendered.locator("strong span.llm").text_content() == "speed"  # highlight inside Markdown
    assert rendered.locator("span.fix").text_content() == "km/h"
    assert rendered.locator("pre code.hljs").count() == 1  # highlighted code, its routed token still marked
    assert "".join(rendered.locator("pre code span.llm").all_text_contents()) == "(300 / 5)"  # across hljs's spans
    assert rendered.locator("img").count() == 0 and "<img" in rendered.text_content()  # text, not markup
    assert "$2 and $3" in rendered.text_content()  # prices are not math
    page.click(".rawToggle")  # raw text is one click away
    assert page.locator(".pane .raw").is_visible() and not rendered.is_visible()
    assert "\\frac" in page.locator(".pane .raw").text_content()


def test_knobs_change_the_request_the_page_sends(page):
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.method == "POST" else None)
    ask(page, "Hi", 8)
    page.wait_for_function("document.querySelector('.pane .status').textContent.startsWith('finished in')")
    assert not [k for k in bodies[-1] if k.startswith("r2r_")]  # untouched knobs: the server's settings
    page.select_option("#routeBy", "rate")
    page.fill("#routeValue", "0.3")
    page.select_option("#verify", "tolerance")
    page.fill("#tolerance", "1.5")
    page.fill("#maxUnverified", "4")
    page.fill("#temperature", "0.7")
    ask(page, "Hi again", 6)
    page.wait_for_function("document.querySelectorAll('.pane .answer').length === 2 && document.querySelector("
                           "'.pane .status').textContent.startsWith('finished in')")
    body = bodies[-1]
    assert body["r2r_llm_rate"] == 0.3 and "r2r_threshold" not in body
    assert body["r2r_verify"] == 1.5 and body["r2r_max_unverified"] == 4
    assert body["max_tokens"] == 6 and body["temperature"] == 0.7
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]  # the conversation goes on
    page.select_option("#verify", "strict")
    page.select_option("#policy", "slm")
    page.check("#compare")
    ask(page, "Once more", 4)
    page.wait_for_function("[...document.querySelectorAll('.pane .status')].every(s => "
                           "s.textContent.startsWith('finished in'))")
    slm_alone, r2r, llm_alone = bodies[-3:]  # one after another, in pane order
    assert (slm_alone["r2r_policy"], slm_alone["r2r_verify"]) == ("slm", "off")
    assert (r2r["r2r_policy"], r2r["r2r_verify"], r2r["r2r_max_unverified"]) == ("slm", "strict", 4)  # the knobs
    # ... but not a rate beside one model alone (the server refuses it): its input is disabled
    assert "r2r_llm_rate" not in r2r and page.is_disabled("#routeValue") and page.is_disabled("#routeBy")
    page.select_option("#verify", "off")
    assert page.is_disabled("#maxUnverified") and page.is_disabled("#tolerance")
    page.select_option("#verify", "")  # one model at the server's setting is not verified: no bound to send
    assert page.is_disabled("#maxUnverified")
    page.select_option("#verify", "strict")
    page.select_option("#policy", "llm")  # the LLM alone has nothing to check
    assert page.is_disabled("#verify") and page.is_disabled("#maxUnverified") and page.is_disabled("#tolerance")
    page.uncheck("#compare")
    ask(page, "And again", 3)
    page.wait_for_function("[...document.querySelectorAll('.pane .status')].every(s => "
                           "s.textContent.startsWith('finished in'))")
    last = bodies[-1]
    assert last["r2r_policy"] == "llm" and "r2r_verify" not in last and "r2r_max_unverified" not in last
    assert (llm_alone["r2r_policy"], llm_alone["r2r_verify"]) == ("llm", "off")
    assert "r2r_llm_rate" not in slm_alone and "r2r_llm_rate" not in llm_alone  # knobs are the R2R pane's


def test_stop_cancels_the_request_on_the_server(page, server):
    ask(page, "Tell me a long story", 400)
    page.wait_for_function("document.querySelectorAll('.pane .raw span').length >= 3", timeout=30000)
    assert httpx.get(server + "/health").json()["running"] == 1
    page.click("#stop")
    assert_idle_soon(server)  # the stream closed and the server dropped the request
    page.wait_for_function("document.querySelector('.pane .status').textContent.startsWith('stopped after')")
    assert page.locator(".pane .raw span").count() < 400
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_phone_width_stacks_the_panes(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 800}, is_mobile=True)
    page = context.new_page()
    page.goto(server + "/")
    page.check("#compare")
    panes = [page.locator(".pane").nth(i) for i in range(3)]
    for pane in panes:  # (laid out by the page's change handler, which a busy machine may run after check() returns)
        pane.wait_for(state="visible")
    boxes = [pane.bounding_box() for pane in panes]
    assert boxes[0]["x"] == boxes[1]["x"] == boxes[2]["x"] and boxes[0]["y"] < boxes[1]["y"] < boxes[2]["y"]
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off the side
    context.close()


def test_without_renderers_the_page_says_so_and_shows_plain_text(browser, server):
    context = browser.new_context()
    page = context.new_page()
    page.route("**/static/vendor/**", lambda route: route.fulfill(status=404, body=""))
    page.goto(server + "/")
    assert "make web" in page.text_content("#note")
    ask(page, "Hi", 4)
    page.wait_for_function("document.querySelector('.pane .status').textContent.startsWith('finished in')")
    assert page.locator(".pane .rendered").text_content() == page.locator(".pane .raw").text_content()
    context.close()

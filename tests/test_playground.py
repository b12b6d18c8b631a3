"""The playground page in headless Chromium: type a question, watch highlighted tokens stream in."""

import shutil

import pytest

from r2r.engine import Engine
from r2r.policies import RandomPolicy
from r2r.server import BackgroundServer, Limits, create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.5, seed=0))
    app = create_app(engine, "tiny-r2r", Limits(max_tokens=64, context_length=256))
    with BackgroundServer(app) as srv:
        yield srv.url


def test_playground_streams_highlighted_tokens(server, tmp_path):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "needs Debian's chromium (make test installs it: apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(server + "/")
            page.fill("#maxTokens", "32")
            page.fill("#question", "What is 48 / 2?")
            page.click("#send")
            page.wait_for_selector(".answer span.llm", state="attached", timeout=30000)
            page.wait_for_function("document.getElementById('tokens').textContent !== '0'")
            rate = page.text_content("#rate")
            assert rate.endswith("%")
            assert page.locator(".answer span").count() >= 2
            assert page.locator(".answer span.llm").count() >= 1
            page.screenshot(path=str(tmp_path / "playground.png"))
            assert (tmp_path / "playground.png").stat().st_size > 0
        finally:
            browser.close()

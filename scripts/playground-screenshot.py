"""The README's picture of the playground's compare mode, on the real pair: starts `r2r serve` on loopback, opens
the page in headless Chromium, asks one question with the panes run one after another (SLM alone, R2R, LLM
alone), waits for all three, saves a screenshot and prints each pane's figures (also as JSON beside it).

    python scripts/playground-screenshot.py [--backend llamacpp] [--verify 1] [--out docs/playground-compare.png]

Nothing else should run meanwhile: the panes' timers are the figures."""

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from roads_to_rome.bench.measure import processor

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="llamacpp")
parser.add_argument("--port", type=int, default=18801)
parser.add_argument("--verify", default="1", help="the R2R pane's verification: off, strict or a tolerance in nats")
parser.add_argument("--max-tokens", type=int, default=600)
parser.add_argument("--question", default="A train covers 6000 m in 75 seconds, then 9 km in 5 minutes. What is its "
                    "average speed over the whole trip, in km/h?")
parser.add_argument("--out", default="docs/playground-compare.png")
args = parser.parse_args()
URL = f"http://127.0.0.1:{args.port}"

server = subprocess.Popen(["r2r", "serve", "--port", str(args.port), "--backend", args.backend],
                          stdout=subprocess.DEVNULL)
try:
    for _ in range(1200):
        try:
            if httpx.get(URL + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.25)
        if server.poll() is not None:
            raise SystemExit(f"r2r serve exited with {server.returncode}")
    with sync_playwright() as p:
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.goto(URL + "/")
        page.wait_for_function("document.getElementById('pair').textContent !== ''")
        page.add_style_tag(content=".log { max-height: none; }")  # the whole answers in one picture
        page.check("#compare")
        page.select_option("#order", "sequential")
        if args.verify in ("off", "strict"):
            page.select_option("#verify", args.verify)
        else:
            page.select_option("#verify", "tolerance")
            page.fill("#tolerance", args.verify)
        page.fill("#maxTokens", str(args.max_tokens))
        page.fill("#question", args.question)
        page.click("#send")
        page.wait_for_function("[...document.querySelectorAll('.pane .status')].every(s => "
                               "/^(finished|stopped|error)/.test(s.textContent))", timeout=900_000)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=args.out, full_page=True)
        panes = {page.get_attribute(f".pane:nth-child({i})", "data-system"):
                 page.text_content(f".pane:nth-child({i}) .stats") for i in (1, 2, 3)}
        browser.close()
finally:
    server.terminate()
    server.wait()
print("measured on", processor())
for system, stats in panes.items():
    print(f"{system:4} {stats}")
Path(args.out).with_suffix(".json").write_text(json.dumps(
    {"question": args.question, "processor": processor(), "backend": args.backend, "verify": args.verify,
     "panes": panes}, indent=1))
print("wrote", args.out)

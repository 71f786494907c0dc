"""The docs' picture of the chat page (docs/images/chat-page.png): a server on the bundled model
under ``serve --memory``, two turns about a chapter of Emma in headless Chromium, a screenshot.

    .venv/bin/python scripts/chat_screenshot.py [OUT.png]
"""

import sys

from playwright.sync_api import sync_playwright

from infinikv.bench.server import running_server
from infinikv.data import load_text

OUT = sys.argv[1] if len(sys.argv) > 1 else "docs/images/chat-page.png"
FLAGS = ["--policy", "bct", "--capacity", "1024", "--memory", "1500MiB"]
BROWSER = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync"]
document = load_text("austen:emma", from_chapter_one=True)[:6000]
questions = [f"Here is the start of a novel.\n\n{document}\n\nWho is Emma Woodhouse?", "And who is Mr. Knightley?"]

with running_server("smollm2-135m", FLAGS) as (base, _), sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER)
    page = browser.new_page(viewport={"width": 960, "height": 900})
    page.goto(base)
    page.wait_for_function("document.querySelectorAll('#policy option').length > 0")
    page.fill("#max-tokens", "96")
    for turn, question in enumerate(questions):
        page.fill("#prompt", question)
        page.press("#prompt", "Enter")
        page.locator(".assistant .turn").nth(turn).wait_for(timeout=600_000)
    page.evaluate("document.querySelector('.user').style.maxHeight = '9em'")  # the document, cut short
    page.evaluate("document.querySelector('.user').style.overflow = 'hidden'")
    page.screenshot(path=OUT, full_page=True)
    browser.close()
print(OUT)

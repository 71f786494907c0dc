"""The chat page in a real headless browser (Debian's Chromium driven by Playwright) against a live
``infinikv serve`` on a tiny model: the key it asks for, the policies it offers, a streamed answer
delivered whole, each turn's K/V numbers, the second turn continuing the first's cache, the
process's memory against ``--memory``, a refused request's message."""

from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from infinikv.bench.server import running_server
from infinikv.policies import REGISTRY

CHROMIUM = Path("/usr/bin/chromium")
KEY = "page-key"
MEMORY = 2**31
# A root process needs --no-sandbox; this machine has no network: no background connections.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync"]


@pytest.fixture(scope="module")
def server(tiny_folder):
    """A live server (default ``bct`` 64, an API key, ``--memory 2GiB``) and Chromium: (base, browser)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    flags = ["--policy", "bct", "--capacity", "64", "--api-key", KEY, "--memory", "2GiB", "--threads", "1"]
    with running_server(str(tiny_folder), flags) as (base, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield base, browser
        browser.close()


def open_page(base: str, browser: Browser) -> Page:
    page = browser.new_context().new_page()  # a context of its own: no key remembered
    page.goto(base)
    return page


@pytest.fixture(scope="module")
def chat(server):
    """The page with the key given and the policies loaded."""
    base, browser = server
    page = open_page(base, browser)
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function("document.querySelectorAll('#policy option').length > 0")
    return page


def ask(page: Page, text: str, turn: int) -> dict[str, str]:
    """Send ``text`` and wait for the ``turn``-th answer (0-based): its text and numbers."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    line = page.locator(".assistant .turn").nth(turn)
    line.wait_for(timeout=120_000)
    answer = page.locator(".assistant").nth(turn).evaluate("e => e.firstChild.textContent")
    return {"answer": answer, **line.evaluate("e => ({...e.dataset})")}


def test_the_page_asks_for_the_key_then_offers_the_policies(server):
    page = open_page(*server)
    page.wait_for_function("document.querySelector('#policy-note').textContent.includes('API key')")
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function(f"document.querySelectorAll('#policy option').length === {len(REGISTRY)}")
    assert page.input_value("#policy") == "bct" and page.input_value("#budget") == "64"
    assert page.locator("#policy option[value=infinigen]").is_disabled()  # not prepared at start
    assert not page.locator("#policy option[value=snapkv]").is_disabled()
    assert "allocated once" in page.text_content("#policy-note")
    page.wait_for_function("Number(document.querySelector('#memory').dataset.budget) > 0")
    memory = page.locator("#memory").evaluate("e => ({...e.dataset})")
    assert int(memory["budget"]) == MEMORY and 0 < int(memory["resident"]) < MEMORY


def test_a_conversation_streams_whole_answers_and_continues_its_cache(chat, server):
    page = chat
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    first = ask(page, "Tell me about the sea.", 0)
    second = ask(page, "And the mountains?", 1)
    assert first["policy"] == second["policy"] == "bct" and first["reused"] == "0"
    assert int(second["reused"]) > int(first["prompt"])  # the first turn's prompt and answer were not prefilled again
    assert int(first["held"]) > 0 and first["answer"]
    # The same first turn sent to the API directly (a fresh prefill: nothing kept starts with it
    # alone) answers the same text as the page assembled from the stream.
    body = {
        "model": page.text_content("#model"),
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 8,
        "temperature": 0,
        "kv": {"policy": "bct", "capacity": 64},
    }
    direct = httpx.post(
        f"{server[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert direct.json()["choices"][0]["message"]["content"] == first["answer"]


def test_a_refused_request_shows_the_servers_message_and_keeps_the_prompt(chat):
    page = chat
    page.click("#new-chat")
    page.select_option("#policy", "full")
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", "A question too long to answer.")
    page.press("#prompt", "Enter")
    error = page.locator(".assistant.error")
    error.wait_for(timeout=60_000)
    assert "trained context" in error.text_content()
    assert page.input_value("#prompt") == "A question too long to answer."

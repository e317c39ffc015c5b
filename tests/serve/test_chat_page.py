"""The chat page at `/`, end to end in a real headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium): a question typed and sent comes back streamed, equal to
the offline API's greedy answer; a long answer is stopped and the server's KV use returns to 0;
the conversation survives a reload; a reasoning model's reasoning is shown folded."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from minerva import LLM, SamplingParams
from tests.helpers.scripted import scripted, write_think_model
from tests.helpers.server import metric, running_server, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

pytestmark = pytest.mark.slow
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("no Chromium here: `apt-get install chromium chromium-driver` (.ci/run does) to run the chat "
                "page in a browser", allow_module_level=True)

STORE = "minerva.chat.v1"


@pytest.fixture(scope="module")
def browser():
    options = Options()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1000,800"):
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    """The server, and a second LLM like its own for offline references (the served one is its
    engine thread's alone)."""
    def load():
        return LLM(str(smollm2_gguf), device="cpu", dtype="float32", kv_cache_memory=128e6)  # ~2700 tokens

    with running_server(load(), served_model_name="smollm2") as (url, _):
        yield url, load()


def answer_length(driver) -> int:
    return driver.execute_script("const e = document.querySelectorAll('.msg.assistant .content');"
                                 "return e.length ? e[e.length - 1].textContent.length : -1;")


def stored(driver) -> list[dict]:
    return json.loads(driver.execute_script(f"return localStorage.getItem('{STORE}')"))["messages"]


def settings(driver, **values) -> None:
    driver.find_element(By.ID, "toggle-settings").click()
    for field, value in values.items():
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    driver.find_element(By.ID, "toggle-settings").click()


def ask(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def idle(driver) -> bool:
    return driver.execute_script("return document.getElementById('stop').hidden")


def test_question_streams_the_greedy_answer(browser, served):
    url, llm = served
    browser.get(url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(url + "/")
    wait_for(lambda: browser.find_element(By.ID, "model").text == "smollm2", what="the model name")
    # left empty, temperature and top-p are not sent: the model's own defaults apply
    assert browser.execute_script("return [temperature.value, document.getElementById('top-p').value]") == ["", ""]
    settings(browser, temperature=0, **{"max-tokens": 48})
    # Every change of the page, recorded by the page itself: the answer's length each time.
    browser.execute_script("window.seen = []; new MutationObserver(() => {"
                           "  const e = document.querySelectorAll('.msg.assistant .content');"
                           "  if (e.length) window.seen.push(e[e.length - 1].textContent.length);"
                           "}).observe(document.getElementById('messages'), {childList: true, subtree: true});")
    ask(browser, "Name three fruits.")
    wait_for(lambda: idle(browser) and answer_length(browser) > 0, timeout=60, what="the answer")
    lengths = browser.execute_script("return window.seen")
    growing = sorted(set(n for n in lengths if n > 0))
    assert len(growing) >= 3, lengths  # seen in several pieces as it streamed, not at once
    messages = stored(browser)
    offline = llm.chat([{"role": "user", "content": "Name three fruits."}],
                       SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    assert messages[-1]["content"] == offline.outputs[0].text
    stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
    assert "tokens/s" in stats and stats.startswith(f"{len(offline.outputs[0].token_ids)} tokens")


def test_stop_aborts_a_long_answer_and_frees_the_kv_cache(browser, served):
    url, _ = served
    settings(browser, temperature=0, **{"max-tokens": 2000})
    ask(browser, "Write a very long story about a dragon and a knight.")  # greedy: past 1500 tokens
    wait_for(lambda: answer_length(browser) > 40, timeout=60,
             what=f"the answer to start (page: {browser.find_element(By.ID, 'messages').text[-300:]!r}, "
                  f"console: {browser.get_log('browser')})")
    assert metric(url, "minerva:num_requests_running") == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: idle(browser), what="the page to stop")
    wait_for(lambda: metric(url, "minerva:kv_cache_used_blocks") == 0
             and metric(url, "minerva:num_requests_running") == 0, what="the server to free the request")
    stopped = answer_length(browser)
    time.sleep(0.5)
    assert answer_length(browser) == stopped  # nothing more arrives
    assert "[stopped]" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
    # The conversation is kept in the browser: a reload shows it; New chat forgets it.
    count = len(stored(browser))
    browser.refresh()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == count, what="the kept conversation")
    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == [] and stored(browser) == []


def test_reasoning_is_shown_folded(browser, tmp_path):
    llm = LLM(str(write_think_model(tmp_path / "think.gguf")), device="cpu", dtype="float32", kv_cache_memory=4e6)
    with scripted() as script, running_server(llm) as (url, _):
        script.say(llm.tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello **there**!<|im_end|>")
        browser.get(url + "/")
        browser.execute_script("localStorage.clear()")
        browser.get(url + "/")
        ask(browser, "Hi")
        wait_for(lambda: idle(browser) and answer_length(browser) > 0, what="the answer")
        details = browser.find_element(By.CSS_SELECTOR, ".msg.assistant details")
        assert details.get_attribute("open") is None  # folded
        assert browser.execute_script("return document.querySelector('.msg.assistant .thinking').textContent") \
            == "The user greets me."
        content = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content")
        assert content.text == "Hello there!" and content.find_element(By.TAG_NAME, "strong").text == "there"
    llm.close()

"""The web UI in a real browser (Debian's chromium driven by Playwright) against a real `mlc-cli serve` on the default
model, with an API key and a LoRA adapter: chat streaming, the key dialog, stop, adapter choice, the dashboard under
load, and the training view of real runs (`mlc-cli train --ui`, then two runs compared on the server's /train).

Every test writes PNG screenshots and prints their paths (a pytest temp dir, or $MLC_WEB_UI_SHOTS when set).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import ServerProcess, wait_for
from tests.support.web_ui import (
    CHROMIUM,
    CHROMIUM_ARGS,
    KEY,
    answers,
    api_metrics,
    last_reply,
    load,
    open_page,
    send,
    settings,
    shot,
    train_config,
    wait_js,
    wait_reply_done,
)

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no {CHROMIUM}: the web UI tests need Debian's "
                                "chromium; run `make browser` as root, or: sudo apt-get install -y chromium")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, default_model_dir):
    """A PEFT LoRA adapter for the default model whose B matrices are not zero, so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mlc.models.hf_checkpoint import transformers_model

    model = transformers_model(default_model_dir)
    torch.manual_seed(3)  # lora_A's random init too: the adapter is the same whichever tests ran before
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("web-ui-adapter") / "support"
    peft.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter):
    with ServerProcess(tmp_path_factory.mktemp("web-ui"), ["--api-key", KEY, "--lora", f"support={adapter}"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 860})
        yield ctx
        ctx.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("MLC_WEB_UI_SHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("web-ui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# fast: end-to-end tests that run in `make test`
def test_chat_asks_for_the_key_streams_a_reply_and_keeps_the_conversation(server, browser, shots):
    for path in ("/", "/dashboard", "/train", "/static/chat.js"):  # pages and scripts hold no data: no key needed
        assert httpx.get(server.url + path).status_code == 200, path
    for path in ("/api/metrics", "/api/train/run?dir=/tmp"):
        assert httpx.get(server.url + path).status_code == 401, path
    page = open_page(browser, server.url + "/", key=False)
    page.wait_for_selector("#key-dialog[open]", timeout=30_000)  # /v1/models answered 401
    shot(page, shots, "chat-key-dialog")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    wait_js(page, "document.querySelectorAll('#model option').length === 2")
    assert page.locator("#model option").all_inner_texts() == ["smollm2-135m-instruct (base)",
                                                                 "support (adapter of smollm2-135m-instruct)"]
    page.evaluate("""() => {
        window.lens = [];
        new MutationObserver(() => {
            const c = [...document.querySelectorAll('.msg.assistant .content')].pop();
            if (c) window.lens.push(c.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    settings(page, max_tokens=48)
    send(page, "Write three short sentences about the sea.")
    wait_js(page, "!document.getElementById('stop').disabled")
    meta = wait_reply_done(page)
    lens = page.evaluate("window.lens")
    assert len({n for n in lens if n > 0}) >= 3, lens  # the text grew in several steps: streamed, not at once
    assert re.search(r"\d+ tokens · [\d.,]+ tok/s · first token [\d.]+ m?s · smollm2-135m-instruct · (stop|length)",
                     meta), meta
    reply = last_reply(page).locator(".content").inner_text()
    assert len(reply) > 10
    shot(page, shots, "chat-streamed")
    stored = page.evaluate("({local: JSON.stringify(localStorage), session: sessionStorage.getItem('mlc.apiKey')})")
    assert "three short sentences about the sea" in stored["local"] and KEY not in stored["local"]
    assert stored["session"] == KEY  # the key lives in this tab's session only
    page.reload()
    page.wait_for_selector(".msg.user")
    assert "about the sea" in page.locator(".msg.user").last.inner_text()
    assert page.locator(".msg.assistant .content").last.inner_text() == reply
    assert not page.errors
    page.close()


def test_markdown_is_rendered_safely_and_tool_calls_and_reasoning_get_their_own_blocks(server, browser, shots):
    """The page renders what the chat API streams: reasoning_content and tool_calls deltas (the route below replays
    such a stream, since the default model writes neither), Markdown with code, and hostile HTML as text."""
    page = open_page(browser, server.url + "/")
    wait_js(page, "document.querySelectorAll('#model option').length === 2")
    hostile = page.evaluate("""() => {
        const d = document.createElement('div');
        d.innerHTML = MLC.markdown('<img src=x onerror=alert(1)> <script>alert(2)</script> [a](javascript:alert(3)) ' +
            '[b](https://e.com/?q="x" onmouseover="alert(4)") **<b>bold</b>**\\n\\n```html\\n<iframe></iframe>\\n```');
        const attrs = [...d.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name));
        return {tags: [...d.querySelectorAll('*')].map(e => e.tagName.toLowerCase()), attrs,
                hrefs: [...d.querySelectorAll('a')].map(a => a.getAttribute('href')), text: d.textContent};
    }""")
    assert not {"img", "script", "iframe"} & set(hostile["tags"]), hostile
    assert not [a for a in hostile["attrs"] if a.startswith("on")]
    assert all(h.startswith("https://") for h in hostile["hrefs"])
    assert "<img src=x onerror=alert(1)>" in hostile["text"] and "<iframe></iframe>" in hostile["text"]

    def delta(**d):
        return {"choices": [{"index": 0, "delta": d}]}

    def call(**f):
        return delta(tool_calls=[{"index": 0, "function": f}])

    events = [delta(role="assistant", reasoning_content="The user wants the "),
              delta(reasoning_content="weather; call the tool."),
              delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]),
              call(arguments='{"city": "Par'), call(arguments='is"}'),
              delta(content="## Plan\n\n- check **Paris**\n\n```python\nprint('ok')\n```"),
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
               "usage": {"prompt_tokens": 9, "completion_tokens": 21, "total_tokens": 30}}]
    body = "".join(f"data: {json.dumps({'id': 'c1', 'model': 'support', **e})}\n\n" for e in events)
    body += "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=body,
                                                                     headers={"content-type": "text/event-stream"}))
    page.click("#new-chat")
    send(page, "What's the weather in Paris?")
    meta = wait_reply_done(page)
    reply = last_reply(page)
    assert reply.locator("details.reasoning summary").inner_text() == "Reasoning"
    assert reply.locator("details.reasoning .block-body").text_content() == "The user wants the weather; call the tool."
    assert reply.locator("details.tool summary").inner_text() == "Tool call: get_weather"
    assert json.loads(reply.locator("details.tool pre").inner_text()) == {"city": "Paris"}
    assert reply.locator(".content h2").inner_text() == "Plan"
    assert reply.locator(".content li strong").inner_text() == "Paris"
    assert reply.locator(".content pre code").inner_text() == "print('ok')"
    assert meta.startswith("21 tokens") and meta.endswith("support · tool_calls")
    shot(page, shots, "chat-tool-calls-and-reasoning")
    page.unroute("**/v1/chat/completions")
    assert not page.errors
    page.close()


def test_every_control_has_a_label_and_pages_fit_a_phone(server, browser, shots):
    unlabelled = """() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())
        .map(e => e.outerHTML)"""
    page = open_page(browser, server.url + "/")
    page.set_viewport_size({"width": 390, "height": 844})
    for path in ("/", "/dashboard", "/train"):
        page.goto(server.url + path)
        page.wait_for_load_state("networkidle")
        assert page.evaluate(unlabelled) == [], path
        assert page.evaluate("document.documentElement.scrollWidth") <= 390, f"{path} scrolls sideways on a phone"
        shot(page, shots, f"phone{path.replace('/', '-') if path != '/' else '-chat'}")
    page.goto(server.url + "/")
    page.focus("#toggle-settings")
    page.keyboard.press("Enter")  # the settings drawer opens from the keyboard, with the focus inside it
    assert page.is_visible("#settings")
    assert page.evaluate("document.getElementById('settings').contains(document.activeElement)")
    shot(page, shots, "phone-chat-settings")
    page.keyboard.press("Escape")
    assert not page.is_visible("#settings")
    assert not page.errors
    page.close()


# slow: each needs the model to generate for a while, or a training run
@pytest.mark.slow
def test_the_chosen_adapter_answers(server, browser, shots):
    page = open_page(browser, server.url + "/")
    wait_js(page, "document.querySelectorAll('#model option').length === 2")
    replies = {}
    for model in ("support", "smollm2-135m-instruct"):
        page.click("#new-chat")
        page.select_option("#model", model)
        settings(page, temperature=0, max_tokens=24)
        send(page, "Name three colors.")
        meta = wait_reply_done(page)
        assert f" · {model} · " in meta, meta  # the stream's `model`: the server answered with this adapter
        replies[model] = last_reply(page).locator(".content").inner_text()
        if model == "support":
            shot(page, shots, "chat-adapter")
    assert replies["support"] != replies["smollm2-135m-instruct"], replies
    assert page.evaluate("JSON.parse(localStorage.getItem('mlc.chat.settings.v1')).model") == "smollm2-135m-instruct"
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_stop_ends_the_request_and_frees_its_pages(server, browser, shots):
    page = open_page(browser, server.url + "/")
    wait_js(page, "document.querySelectorAll('#model option').length === 2")
    page.click("#new-chat")
    settings(page, temperature=0.8, max_tokens=400)
    before = api_metrics(server)["now"]["requests_finished"].get("abort", 0)
    send(page, "Write a very long story about a dragon who learns to cook, with many chapters.")
    wait_js(page, "([...document.querySelectorAll('.msg.assistant .content')].pop().textContent.length > 40)")
    assert api_metrics(server)["now"]["running"] == 1
    page.click("#stop")
    meta = wait_reply_done(page, 10)
    assert meta.endswith("stopped") and page.locator(".msg.assistant .meta.stopped").count() == 1
    text = last_reply(page).locator(".content").inner_text()

    def ended():
        now = api_metrics(server)["now"]
        return (now["running"] == 0 and now["requests_finished"].get("abort", 0) == before + 1
                and now["kv_pages_free"] == now["kv_pages_total"])

    assert wait_for(ended, timeout=10), api_metrics(server)["now"]  # aborted at once, its KV pages back
    time.sleep(0.5)
    assert last_reply(page).locator(".content").inner_text() == text  # nothing arrives after Stop
    shot(page, shots, "chat-stopped")
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_dashboard_numbers_move_under_load(server, browser, shots):
    page = open_page(browser, server.url + "/dashboard")
    wait_js(page, "/^\\d+$/.test(document.getElementById('tile-finished').textContent)")
    finished = int(page.inner_text("#tile-finished"))
    threads = load(server, 4, 64)
    wait_js(page, "Number(document.getElementById('tile-running').textContent) >= 2", 30)
    wait_js(page, "parseFloat(document.getElementById('tile-tps').textContent) > 0", 30)
    assert float(page.inner_text("#tile-kv").split()[0]) > 0
    shot(page, shots, "dashboard-under-load")
    for t in threads:
        t.join()
    wait_js(page, f"Number(document.getElementById('tile-finished').textContent) >= {finished + 4}", 15)
    wait_js(page, "document.getElementById('tile-running').textContent === '0'", 15)
    assert page.inner_text("#tile-ttft").endswith("ms") or page.inner_text("#tile-ttft").endswith(" s")
    assert "p50 · p90 · p99: " in page.inner_text("#tile-tpot-sub") and "–" not in page.inner_text("#tile-tpot-sub")
    assert "running" in page.get_attribute("#chart-req", "aria-label")
    shot(page, shots, "dashboard-after-load")
    assert not page.errors
    page.close()


@pytest.mark.slow
def test_training_view_live_with_train_ui_then_two_runs_compared_on_the_server(server, browser, shots, tmp_path):
    import subprocess
    import sys

    from mlc.train.checkpoint import list_checkpoints
    from tests.support.server_process import free_port
    from tests.support.tiny_llama import build_tiny_llama

    build_tiny_llama(tmp_path / "model")
    steps = 400  # run A: long enough (about 5 s here) that the --ui page sees it move between its 2 s polls
    rows = [{"instruction": f"Where is order {i}?", "output": f"Order {i} ships on day {i % 5}. Thank you!"}
            for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    port = free_port()
    train = [sys.executable, "-m", "mlc.cli.main", "train", "--quiet", "--config"]
    a = subprocess.Popen([*train, str(train_config(tmp_path, "lr-1e-2", 1e-2, steps)), "--ui", "--ui-port", str(port),
                          "--inject-nonfinite-steps", "30"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    b = subprocess.Popen([*train, str(train_config(tmp_path, "lr-3e-3", 3e-3, 40))], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        ui = f"http://127.0.0.1:{port}/"
        assert wait_for(lambda: answers(ui + "api/train/ui"), timeout=60), "the --ui page never answered"
        page = open_page(browser, ui, key=False)  # redirected to /train?run=<this run>
        wait_js(page, f"/^[1-9]\\d* \\/ {steps}$/.test(document.getElementById('tile-step').textContent)", 90)
        first = int(page.inner_text("#tile-step").split()[0])
        if first < steps:  # still running: the page follows it live, unless the run ends (and its --ui server
            # with it, as no terminal is attached) before the page's next poll, as only a very fast machine does
            later = f"Number(document.getElementById('tile-step').textContent.split(' ')[0]) > {first}"
            wait_js(page, later, 60, give_up=lambda: a.poll() is not None)
        assert page.inner_text("#tile-status") in ("running", "finished")
        assert page.locator("#nav a").all_inner_texts() == ["Training"]
        shot(page, shots, "train-ui-live")
        page.close()
        out, _ = a.communicate(timeout=240)
        assert a.returncode == 0 and b.wait(timeout=240) == 0, out
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
    run_a, run_b = tmp_path / "lr-1e-2", tmp_path / "lr-3e-3"
    page = open_page(browser, f"{server.url}/train?run={run_a}&compare={run_b}")
    wait_js(page, "document.getElementById('tile-status').textContent === 'finished'", 30)
    assert page.inner_text("#tile-step") == f"{steps} / {steps}" and page.inner_text("#tile-skipped") == "1"
    assert page.inner_text("#tile-eta") == "done" and page.inner_text("#tile-loss-sub").startswith("eval ")
    table = page.locator("#compare-table tr").all_inner_texts()
    assert "lr-1e-2 (A)" in table[0] and "lr-3e-3 (B)" in table[0] and f"{steps} / {steps}\t40 / 40" in table[2]
    rows = page.locator("#checkpoints tbody tr").count()
    assert rows == len(list_checkpoints(run_a)) + len(list_checkpoints(run_b)) >= 3
    assert f"{steps} logged steps" in page.get_attribute("#chart-loss", "aria-label")
    inked = page.evaluate("""() => { const c = document.getElementById('chart-loss');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 150 && d[i] < 120 && d[i + 3] > 200) n++; return n; }""")
    assert inked > 500, inked  # run A's blue curves are drawn, not only the grey axes
    shot(page, shots, "train-compare-on-server")
    assert not page.errors
    page.close()

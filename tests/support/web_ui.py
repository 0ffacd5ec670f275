"""Helpers of the web UI tests (tests/integration/test_web_ui.py): a page with the API key, waiting on the page,
screenshots, load, and small training runs."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx

CHROMIUM = os.environ.get("MLC_CHROMIUM", "/usr/bin/chromium")  # Debian's; `make browser` installs it
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "web-ui-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}
WITH_KEY = f"sessionStorage.setItem('mlc.apiKey', {json.dumps(KEY)})"


def shot(page, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def wait_js(page, expression: str, timeout: float = 60.0, give_up=None):
    """Poll `expression` in the page until truthy (Playwright's wait_for_function evaluates strings, which the
    pages' Content-Security-Policy forbids, as it should). `give_up()` true ends the wait early with None: the
    page can no longer change (its server exited)."""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if not value and give_up is not None and give_up():
            return None
        if value or time.monotonic() > deadline:
            assert value, f"timed out after {timeout}s waiting for {expression}"
            return value
        time.sleep(0.1)


def open_page(browser, url: str, key: bool = True):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    if key:
        page.add_init_script(WITH_KEY)
    page.goto(url)
    page.errors = errors
    return page


def settings(page, **values) -> None:
    for field, value in values.items():
        page.fill(f"#{field}", str(value))
        page.dispatch_event(f"#{field}", "change")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator(".msg.assistant").last


def wait_reply_done(page, timeout: float = 60.0) -> str:
    wait_js(page, "!document.getElementById('send').disabled", timeout)
    return last_reply(page).locator(".meta").inner_text()


def api_metrics(server) -> dict:
    return httpx.get(server.url + "/api/metrics", headers=AUTH, timeout=10).json()


def load(server, n: int, max_tokens: int) -> list[threading.Thread]:
    def one(i: int):
        body = {"messages": [{"role": "user", "content": f"Count from {i} to {i + 50}."}], "max_tokens": max_tokens,
                "ignore_eos": True}
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120).raise_for_status()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def train_config(root: Path, name: str, lr: float, steps: int) -> Path:
    import yaml

    cfg = {"model": str(root / "model"), "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl")},
           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
           "optimizer": {"lr": lr}, "lr_schedule": {"warmup_steps": 3}, "batch_size": 4, "max_steps": steps,
           "max_seq_len": 64, "save_every": 20, "eval_every": 20, "log_every": 1, "seed": 7, "precision": "fp32",
           "output_dir": str(root / name)}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False

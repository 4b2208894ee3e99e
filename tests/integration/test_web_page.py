"""The web page at /ui (issue 31), in a real headless Chromium against the real service.

Debian's chromium (`apt-get install chromium`, which `install.sh --test`
does as root) driven by Playwright's Python package; Playwright's own
browser download is never used. Without a chromium binary the tests skip.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from tests.harness import BASE_CONFIG, RunningService

pytestmark = pytest.mark.integration

CHROMIUM = next((path for path in (os.environ.get("TRAY_APP_CHROMIUM"), shutil.which("chromium"),
                                   shutil.which("chromium-browser")) if path), None)
try:
    from playwright import sync_api as playwright_api
    from playwright.sync_api import expect
except ImportError:  # the test extra is not installed: the browser tests skip, the rest run
    playwright_api = expect = None

LONG_ANSWER = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
DESKTOP, PHONE = {"width": 1280, "height": 900}, {"width": 390, "height": 844}
# A model name that would run a script if the page put the service's text in as HTML.
HOSTILE_NAME = '<img src=x onerror="document.title=`pwned`">'
# Model text with every Markdown piece the chat renders, and three ways to smuggle markup in.
MARKDOWN_ANSWER = """# Plan
Some **bold**, some *italic* and `x < y` inline.

- first item
- second with [a link](https://example.org/docs)

1. one
2. two

```python
print("<b>not bold</b>")
```

[a trap](javascript:document.title='pwned') and <img src=x onerror="document.title='pwned'">
<script>document.title='pwned'</script>"""
SET_VISIBILITY = """state => {
    Object.defineProperty(document, 'visibilityState', {value: state, configurable: true});
    document.dispatchEvent(new Event('visibilitychange'));
}"""


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium binary (apt-get install chromium, or set TRAY_APP_CHROMIUM)")
    if playwright_api is None:
        pytest.skip("the playwright package is missing (pip install -e '.[test]')")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"the page's script failed: {errors}"


def chat(service, request_id, client=None, max_tokens=60, **extra):
    headers = {"X-Request-Id": request_id, **({"X-Client-Name": client} if client else {})}
    return service.http.post("/v1/chat/completions", headers=headers, json={
        "messages": LONG_ANSWER, "max_tokens": max_tokens, "temperature": 0, **extra})


def test_the_page_is_served_from_the_package_and_loads_nothing_from_outside(fresh):
    page = fresh.http.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http" not in page.text.replace('content="width', "")  # no outside URL in the page
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        asset = fresh.http.get(f"/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    missing = fresh.http.get("/ui/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_the_page_polls_status_only_while_it_is_visible(fresh, page):
    page.clock.install()  # the page's timers run only when the test advances them
    status_calls: list[str] = []
    page.on("request", lambda request: status_calls.append(request.url) if request.url.endswith("/status") else None)
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#state")).to_have_text("Serving on the GPU")
    # No key: the page says what that opens, and how to close it.
    expect(page.locator("#no-key")).to_be_visible()
    expect(page.locator("#no-key")).to_contain_text("tray-app keys add")
    with page.expect_request("**/status"):
        page.clock.run_for(1000)  # the tray's rate
    page.evaluate(SET_VISIBILITY, "hidden")
    assert page.evaluate("pollTimer === null"), "a poll is still waiting to run"
    seen = len(status_calls)
    page.clock.run_for(30_000)
    assert len(status_calls) == seen, "a hidden page kept polling /status"
    with page.expect_request("**/status"):
        page.evaluate(SET_VISIBILITY, "visible")  # shown again: at once, not a second later


def test_the_charts_draw_from_the_pages_own_updates(fresh, page):
    page.clock.install()  # one poll per run_for, whatever the machine's speed
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#state")).to_have_text("Serving on the GPU")
    for chart in ("vram", "ram"):
        expect(page.locator(f'[data-chart="{chart}"] polyline')).to_have_count(1)
    with page.expect_response("**/status"):
        page.clock.run_for(1000)
    # Two samples a second apart: a line between two different x positions.
    two_points = re.compile(r"^(\d+\.\d+),\d+\.\d+ (?!\1,)\d+\.\d+,\d+\.\d+$")
    for chart, title in (("vram", "Free VRAM"), ("ram", "Available RAM")):
        figure = page.locator(f'[data-chart="{chart}"]')
        expect(figure.locator("polyline")).to_have_attribute("points", two_points)
        expect(figure.locator("figcaption")).to_contain_text(re.compile(title + r"[\d,.]+ (MiB|GiB)"))
        expect(figure.locator(".axis")).to_contain_text("scale 0 –")
    expect(page.locator('[data-chart="vram"] line.threshold')).to_have_count(1)  # the reserve
    # A page left hidden measured nothing: its line breaks instead of bridging the gap.
    page.evaluate(SET_VISIBILITY, "hidden")
    page.clock.run_for(60_000)
    with page.expect_response("**/status"):
        page.evaluate(SET_VISIBILITY, "visible")
    expect(page.locator('[data-chart="ram"] polyline')).to_have_count(2)


def test_recent_requests_show_a_request_with_its_route_reason(fresh, page):
    fresh.http.post("/admin/gpu", json={"paused": True})
    try:
        answer = chat(fresh, "web-recent-cpu", max_tokens=2)
        assert answer.status_code == 200
    finally:
        fresh.http.post("/admin/gpu", json={"paused": False})
    page.goto(f"{fresh.url}/ui")
    row = page.locator('#recent li[data-request-id="web-recent-cpu"]')
    # Who sent it (its client name, here httpx's User-Agent) and which model answered.
    expect(row).to_contain_text(re.compile(r"^\d\d:\d\d:\d\d · python-httpx/\S+ · SmolLM2\S+ · CPU · GPU paused \(force CPU\)"))
    expect(page.locator("#recent-empty")).to_be_hidden()
    # The CPU drafts by default (ngram-mod): the default model's row says so.
    cpu = next(w for w in fresh.status()["workers"] if w["role"] == "cpu")
    expect(page.locator("#models li").first).to_contain_text(f"speculative decoding: {cpu['speculative']} on the CPU")


def test_the_log_view_shows_the_workers_log(fresh, page):
    logs = {w["role"]: Path(w["log"]) for w in fresh.status()["workers"]}
    # A line each worker wrote to its file, and so to the tray's log viewer.
    last = {role: [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-1]
            for role, path in logs.items()}
    page.goto(f"{fresh.url}/ui")
    view = page.locator("#logs")
    expect(view).to_contain_text(last["gpu"])  # the GPU worker's, read as the page opens
    expect(page.locator("#logs-count")).to_contain_text(re.compile(r"^the last \d+ lines$"))
    page.get_by_label("Worker").select_option("cpu")
    expect(view).to_contain_text(last["cpu"])
    page.get_by_label("Filter").fill("no line says this")
    expect(view).to_be_empty()
    expect(page.locator("#logs-count")).to_contain_text(re.compile(r"^0 of the last \d+ lines$"))


def test_the_log_route_is_bounded_and_says_what_is_wrong(fresh):
    five = fresh.http.get("/admin/logs", params={"worker": "cpu", "lines": 5})
    assert five.status_code == 200
    assert five.json()["worker"] == "cpu" and 1 <= len(five.json()["lines"]) <= 5
    for params, param in (({"worker": "tpu"}, "worker"), ({}, "worker"), ({"worker": "gpu", "lines": 0}, "lines"),
                          ({"worker": "gpu", "lines": 1001}, "lines"), ({"worker": "gpu", "lines": "all"}, "lines")):
        bad = fresh.http.get("/admin/logs", params=params)
        assert bad.status_code == 400, params
        assert bad.json()["error"]["code"] == "invalid_value" and bad.json()["error"]["param"] == param
    unknown = fresh.http.get("/admin/logs", params={"worker": "gpu", "model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_chat_renders_markdown_and_model_text_never_becomes_markup(fresh, page):
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#state")).to_have_text("Serving on the GPU")
    # The tiny model won't write this; the page's renderer gets it as a stream would leave it.
    page.evaluate("text => showAnswer(text)", MARKDOWN_ANSWER)
    answer = page.locator("#chat-answer")
    expect(answer.locator("h3")).to_have_text("Plan")
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("em")).to_have_text("italic")
    expect(answer.locator("p code")).to_have_text("x < y")
    expect(answer.locator("ul li")).to_have_count(2)
    expect(answer.locator("ol li")).to_have_text(["one", "two"])
    expect(answer.locator("pre code")).to_have_text('print("<b>not bold</b>")')
    expect(answer.locator("pre code")).to_have_attribute("data-language", "python")
    link = answer.locator("a")
    expect(link).to_have_count(1)  # the javascript: one stays text
    expect(link).to_have_attribute("href", "https://example.org/docs")
    expect(link).to_have_attribute("rel", "noopener noreferrer")
    expect(answer).to_contain_text("[a trap](javascript:")
    expect(answer).to_contain_text("<img src=x onerror=")
    expect(answer).to_contain_text("<script>")
    expect(answer.locator("img, script, b")).to_have_count(0)
    assert page.title() != "pwned"
    # An answer still streaming inside a code fence shows as code so far.
    page.evaluate("text => showAnswer(text)", "Here:\n```\nlet a = 1;")
    expect(answer.locator("pre code")).to_have_text("let a = 1;")


def test_the_page_works_by_keyboard(fresh, page):
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#models li")).not_to_have_count(0)
    reached = []
    for _ in range(60):
        page.keyboard.press("Tab")
        focused = page.evaluate("""() => {
            const e = document.activeElement;
            if (e === document.body) return null;  // past the last control
            return [e.id || e.getAttribute('aria-label') || e.textContent, getComputedStyle(e).outlineStyle];
        }""")
        if focused is None:
            break
        reached.append(focused[0])
        assert focused[1] != "none", f"{focused[0]} has no visible focus"
    wanted = ["give-back", "chat-model", "chat-prompt", "chat-send", "logs-worker", "logs-filter", "logs-refresh", "logs"]
    assert [name for name in reached if name in wanted][:len(wanted)] == wanted, reached
    assert any(str(name).startswith("Unload ") for name in reached)
    # Escape stops a streaming answer, and the server ends that request too.
    page.get_by_label("Message").fill("Write a long story about a lighthouse keeper and the sea.")
    page.get_by_label("Message").press("Control+Enter")
    expect(page.get_by_role("button", name="Stop")).to_be_visible()
    expect(page.locator("#chat-route")).not_to_be_empty()
    page.keyboard.press("Escape")
    expect(page.locator("#chat-answer .error")).to_have_text("Stopped.")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    fresh.wait_for(lambda s: not [r for r in s["requests"] if r["state"] in ("queued", "running")],
                   what="the stopped request ended on the server")


def test_degraded_banner_appears_and_cancels_a_queued_request(fresh, page):
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#state")).to_have_text("Serving on the GPU")
    expect(page.locator("#banner")).to_be_hidden()
    fresh.http.post("/admin/gpu", json={"paused": True})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Holds the one CPU slot until this test cancels it (no EOS, a long
        # limit): the queued request stays queued however fast the CPU is.
        blocker = pool.submit(chat, fresh, "web-blocker", max_tokens=1500, ignore_eos=True)
        fresh.wait_for(lambda s: any(r["id"] == "web-blocker" and r["state"] == "running" for r in s["requests"]),
                       what="blocker running")
        queued = pool.submit(chat, fresh, "web-queued", "notes-app")
        fresh.wait_for(lambda s: any(r["id"] == "web-queued" and r["state"] == "queued" for r in s["requests"]),
                       what="queued")
        banner = page.locator("#banner")
        expect(banner).to_be_visible()
        expect(page.locator("#banner-title")).to_have_text("Degraded: the CPU is serving")
        expect(page.locator("#banner-model")).not_to_be_empty()
        expect(page.locator("#banner-latency")).to_contain_text("about")
        row = banner.locator("li", has=page.locator('[data-request-id="web-queued"]'))
        expect(row).to_contain_text("notes-app · 1st in the CPU queue · about")
        row.get_by_role("button", name="Cancel").click()
        canceled = queued.result()
        assert canceled.status_code == 499 and canceled.json()["error"]["code"] == "request_canceled"
        assert fresh.http.delete("/v1/requests/web-blocker").status_code == 200
        assert blocker.result().status_code == 499
    fresh.http.post("/admin/gpu", json={"paused": False})
    expect(page.locator("#banner")).to_be_hidden()


def test_unload_and_load_a_model_from_the_page(fresh, page):
    page.goto(f"{fresh.url}/ui")
    model = fresh.status()["models"][0]["name"]
    row = page.locator("#models li", has_text=model)
    expect(row).to_contain_text("on the GPU")
    load = row.get_by_role("button", name=f"Load {model}", exact=True)
    expect(load).to_be_disabled()
    row.get_by_role("button", name=f"Unload {model}", exact=True).click()
    # The GPU worker lets go; the CPU worker, loaded too, still holds it.
    expect(row).to_contain_text("on the CPU")
    expect(load).to_be_enabled()
    assert fresh.status()["models"][0]["gpu"] == "unloaded_idle"
    load.click()
    expect(row).to_contain_text("on the GPU", timeout=60_000)


def test_give_the_gpu_back_and_use_it_again(fresh, page):
    page.goto(f"{fresh.url}/ui")
    page.get_by_role("button", name="Give the GPU back now").click()
    expect(page.locator("#residency")).to_have_text("GPU: given back by you")
    assert fresh.status()["gpu"]["residency"]["state"] == "given_back_by_user"
    page.get_by_role("button", name="Use the GPU again").click()
    expect(page.get_by_role("button", name="Give the GPU back now")).to_be_visible(timeout=60_000)
    assert fresh.status()["gpu"]["residency"]["state"] in ("loading", "loaded")


def bound_the_answers(page, max_tokens=40):
    """The page asks for no limit, and the tiny model sometimes rambles to
    its context's end, minutes on a busy machine: the test's requests carry
    a limit, added on their way out; the answer still streams from the service."""
    def add_limit(route):
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data or "{}"), "max_tokens": max_tokens}))
    page.route("**/v1/chat/completions", add_limit)


def test_chat_streams_an_answer_with_its_route_line(fresh, page):
    bound_the_answers(page)
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#chat-model option")).not_to_have_count(0)
    page.get_by_label("Message").fill("Say hello.")
    page.get_by_role("button", name="Send").press("Enter")  # by keyboard, as a real button takes it
    expect(page.locator("#chat-route")).to_have_text("served by GPU · admitted")
    expect(page.locator("#chat-answer")).not_to_be_empty()
    # The stream's end re-enables Send.
    expect(page.get_by_role("button", name="Send")).to_be_enabled(timeout=120_000)
    expect(page.get_by_role("button", name="Stop")).to_be_hidden()


def test_the_services_text_is_shown_as_text_never_as_markup(fresh, page):
    # A name no picker offers, so the service's refusal quotes it back. Put
    # into the request on its way out: an option edited in the page is put
    # back by the page's next status refresh (renderModels), which raced the click.
    def hostile_model(route):
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data or "{}"), "model": HOSTILE_NAME}))
    page.route("**/v1/chat/completions", hostile_model)
    page.goto(f"{fresh.url}/ui")
    expect(page.locator("#chat-model option")).not_to_have_count(0)
    page.get_by_label("Message").fill("Say hello.")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#chat-answer")).to_contain_text(HOSTILE_NAME)
    expect(page.locator("#chat-answer img")).to_have_count(0)
    assert page.title() != "pwned"


def test_usage_shows_what_an_app_sent_today_and_over_7_days(fresh, page):
    app = f"usage-{uuid.uuid4().hex[:8]}"  # the usage file outlives a test; this name is this test's alone
    assert chat(fresh, "web-usage", app, max_tokens=3).status_code == 200
    page.goto(f"{fresh.url}/ui")
    row = page.locator(f'#usage li[data-usage-name="{app}"]')
    expect(row).to_contain_text(re.compile(r"today: 1 request \(GPU 1\) · \d+ tokens in · [1-3] out"))
    expect(row).to_contain_text(re.compile(r"7 days: 1 request \(GPU 1\)"))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    service = RunningService(tmp_path_factory.mktemp("keyed"), BASE_CONFIG, env={"TRAY_APP_API_KEY": "web-page-key"})
    service.http.headers["Authorization"] = "Bearer web-page-key"
    try:
        service.wait_ready()
        yield service
    finally:
        service.stop()


def test_with_a_key_the_page_logs_in_and_every_change_needs_the_csrf_token(keyed, page):
    page.goto(f"{keyed.url}/ui")
    expect(page.locator("#login")).to_be_visible()
    page.get_by_label("API key").fill("not-the-key")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#login-error")).to_contain_text("wrong API key")
    page.get_by_label("API key").fill("web-page-key")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#state")).to_have_text("Serving on the GPU")
    expect(page.locator("#no-key")).to_be_hidden()
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["tray_app_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["value"] != "web-page-key"
    assert not cookies["tray_app_csrf"]["httpOnly"]
    # The same cookie without the CSRF header, as a forged request would come: refused.
    forged = page.evaluate("""async () => {
        const r = await fetch('/admin/gpu', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                             body: JSON.stringify({paused: true})});
        return [r.status, (await r.json()).error.code];
    }""")
    assert forged == [403, "csrf_token_invalid"] and keyed.status()["service"]["gpu_paused"] is False
    page.get_by_role("button", name="Give the GPU back now").click()
    expect(page.locator("#residency")).to_have_text("GPU: given back by you")
    keyed.http.post("/admin/gpu", json={"given_back": False})
    page.get_by_role("button", name="Log out").click()
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("fetch('/status').then(r => r.status)") == 401


def log_in(page, service, key="web-page-key"):
    page.goto(f"{service.url}/ui")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#state")).to_have_text("Serving on the GPU")


def test_an_admin_adds_a_key_from_the_page_sees_it_once_and_revokes_it(keyed, page):
    log_in(page, keyed)
    keys = page.locator("#keys-section")
    expect(keys).to_be_visible()
    keys.get_by_label("App name").fill("bad name")
    keys.get_by_role("button", name="Add key").click()
    expect(page.locator("#keys-error")).to_contain_text("must be 1-64 letters")
    keys.get_by_label("App name").fill("web-notes")
    keys.get_by_label("Models").fill(keyed.status()["models"][0]["name"])
    keys.get_by_role("button", name="Add key").click()
    dialog = page.get_by_role("dialog", name="Key for web-notes")
    expect(dialog).to_be_visible()
    raw = dialog.get_by_label("Key").input_value()
    assert raw.startswith("tak_")
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    assert httpx.post(f"{keyed.url}/admin/gpu", headers={"Authorization": f"Bearer {raw}"},
                      json={"paused": True}).status_code == 403
    page.keyboard.press("Escape")  # closes the dialog, and the raw key leaves the page
    expect(dialog).to_be_hidden()
    assert raw not in page.content()
    row = page.locator('#keys li[data-key-name="web-notes"]')
    expect(row).to_contain_text("inference · models: ")
    row.get_by_role("button", name="Revoke web-notes").click()
    question = page.get_by_role("dialog", name="Revoke web-notes?")
    expect(question).to_be_visible()
    page.keyboard.press("Escape")  # changed their mind: nothing is revoked
    expect(question).to_be_hidden()
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 200
    row.get_by_role("button", name="Revoke web-notes").click()
    question.get_by_role("button", name="Revoke").click()
    expect(row).to_have_count(0)
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {raw}"}).status_code == 401


def test_an_inference_keys_page_shows_the_service_without_the_admin_controls(keyed, page):
    made = keyed.http.post("/admin/keys", json={"name": "web-phone-app"})
    assert made.status_code == 201
    try:
        log_in(page, keyed, made.json()["key"])
        expect(page.locator("#models li")).not_to_have_count(0)
        expect(page.locator("body")).to_have_class("not-admin")
        for hidden in ("#give-back", "#models button", "#keys-section", "#logs-section"):
            expect(page.locator(hidden).first).to_be_hidden()
        expect(page.locator("#chat-send")).to_be_visible()
    finally:
        assert keyed.http.delete("/admin/keys/web-phone-app").status_code == 200


def test_the_key_routes_check_every_field_and_only_an_admin_reaches_them(keyed):
    http = keyed.http
    for body, param in (({"name": 7}, "name"), ({"name": "api_key"}, "name"), ({"name": "x", "scope": "root"}, "scope"),
                        ({"name": "x", "models": "all"}, "models"), ({"name": "x", "max_concurrency": 0},
                                                                      "max_concurrency"),
                        ({"name": "x", "max_concurrency": True}, "max_concurrency"), ({"name": "x", "owner": "me"},
                                                                                         "owner")):
        bad = http.post("/admin/keys", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (body, bad.text)
    made = http.post("/admin/keys", json={"name": "web-reader", "max_concurrency": 2})
    assert made.status_code == 201 and made.json()["scope"] == "inference" and made.json()["key"].startswith("tak_")
    try:
        assert http.post("/admin/keys", json={"name": "web-reader"}).json()["error"]["code"] == "key_exists"
        listed = http.get("/admin/keys").json()["keys"]
        reader = next(k for k in listed if k["name"] == "web-reader")
        assert reader["max_concurrency"] == 2 and "key" not in reader and "sha256" not in reader
        as_reader = {"Authorization": f"Bearer {made.json()['key']}"}
        assert httpx.get(f"{keyed.url}/admin/keys", headers=as_reader).status_code == 403
        assert httpx.delete(f"{keyed.url}/admin/keys/web-reader", headers=as_reader).status_code == 403
    finally:
        assert http.delete("/admin/keys/web-reader").status_code == 200
    gone = http.delete("/admin/keys/web-reader")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "key_not_found"


def test_login_sets_a_session_cookie_and_changes_with_it_need_the_csrf_header(keyed):
    anonymous = httpx.Client(base_url=keyed.url)
    assert anonymous.get("/ui").status_code == 200  # the page itself holds no data
    assert anonymous.get("/status").status_code == 401
    wrong = anonymous.post("/ui/login", json={"key": "not-the-key"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key" and not wrong.cookies
    assert anonymous.post("/ui/login", json={}).json()["error"]["code"] == "invalid_request"
    browser_like = httpx.Client(base_url=keyed.url)
    login = browser_like.post("/ui/login", json={"key": "web-page-key"})
    assert login.status_code == 200
    session_cookie = next(h for h in login.headers.get_list("set-cookie") if h.startswith("tray_app_session="))
    assert "HttpOnly" in session_cookie and "SameSite=Strict" in session_cookie and "Path=/" in session_cookie
    assert "web-page-key" not in session_cookie
    assert browser_like.get("/status").status_code == 200
    refused = browser_like.post("/admin/gpu", json={"paused": True})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_token_invalid"
    wrong_token = browser_like.post("/admin/gpu", json={"paused": True}, headers={"X-CSRF-Token": "guess"})
    assert wrong_token.status_code == 403
    csrf = {"X-CSRF-Token": browser_like.cookies["tray_app_csrf"]}
    assert browser_like.post("/admin/gpu", json={"paused": True}, headers=csrf).json()["gpu_paused"] is True
    assert browser_like.post("/admin/gpu", json={"paused": False}, headers=csrf).json()["gpu_paused"] is False
    # Logged out: the cookie no longer opens anything.
    assert browser_like.post("/ui/logout", headers=csrf).status_code == 200
    browser_like.cookies.set("tray_app_session", login.cookies["tray_app_session"])
    assert browser_like.get("/status").status_code == 401


@pytest.mark.skipif(not os.environ.get("TRAY_APP_SCREENSHOTS"), reason="set TRAY_APP_SCREENSHOTS=1 to refresh "
                    "docs/screenshots/web-*.png")
@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_screenshots(fresh, browser, size, scheme):
    context = browser.new_context(viewport=DESKTOP if size == "desktop" else PHONE, color_scheme=scheme)
    page = context.new_page()
    fresh.http.post("/admin/gpu", json={"paused": True})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(chat, fresh, f"shot-{i}", client) for i, client in enumerate(("notes-app", "open-webui"))]
        fresh.wait_for(lambda s: len([r for r in s["requests"] if r["state"] == "queued"]) == 1, what="one queued")
        page.clock.install()  # a minute of the charts in a moment: each run_for is one poll
        page.goto(f"{fresh.url}/ui")
        expect(page.locator("#banner-requests li")).to_have_count(2)
        for _ in range(60):
            with page.expect_response("**/status"):
                page.clock.run_for(1000)
        expect(page.locator("#logs")).not_to_be_empty()
        page.screenshot(path=str(SCREENSHOTS / f"web-{size}-{scheme}.png"), full_page=True)
        for i in range(2):
            fresh.http.delete(f"/v1/requests/shot-{i}")
        [future.result() for future in futures]
    context.close()

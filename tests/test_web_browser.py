"""The web view in headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) against the app `trajstore serve` runs (tests/web_demo.py serve_here), on
127.0.0.1, over the demo's runs. Each page is checked against the CLI, through what it drew
(data-* attributes on rows and SVG marks), and photographed: with
TRAJSTORE_WEB_SCREENSHOTS=docs/web these are the screenshots in docs/web.md.

Without /usr/bin/chromium or /usr/bin/chromedriver (`make test` installs them)
the tests skip with that reason; with CI set they fail instead.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import web_demo
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait
from trajstore.examples.demo import FAULT_ROLLOUTS

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TOKEN = "web-browser-s3cret"
WAIT_S = 90  # a ceiling for a loaded 2-core box, not a measured time
#: the only host the browser can reach (tests/web_demo.py serves there)
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return web_demo.demo_store(tmp_path_factory)


@pytest.fixture(scope="module")
def base(store: Path) -> Iterator[str]:
    with web_demo.serve_here(store) as url:
        yield url


_MISSING = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
_WHY = (
    f"browser tests need Debian's chromium and chromium-driver ({', '.join(_MISSING)} "
    "missing; `make test` installs them)"
)
if _MISSING and not os.environ.get("CI"):  # one line for the whole module
    pytest.skip(_WHY, allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if _MISSING:  # under CI: every test fails with the reason, never a skip
        pytest.fail(_WHY, pytrace=False)
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    # as on a machine without internet: any host but the server's is unresolvable
    options.add_argument(f"--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE {LOOPBACK}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("TRAJSTORE_WEB_SCREENSHOTS")
    folder = Path(chosen) if chosen else tmp_path_factory.mktemp("web-shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shoot(driver: WebDriver, folder: Path, name: str) -> None:
    """The page as rendered, down to its end (at most 2200 px), as folder/name.png."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    clip = {"x": 0, "y": 0, "width": 1400, "height": min(int(height), 2200), "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip}
    )
    (folder / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], Any]) -> Any:
    return WebDriverWait(driver, WAIT_S).until(condition)


def elements(driver: WebDriver, css: str) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, css)


def cli_json(*args: str) -> tuple[int, Any]:
    code, out = web_demo.cli(*args)
    return code, json.loads(out)


def _steps(store: Path, run: str, *filters: str) -> list[dict]:
    """`trajstore query steps --run RUN FILTERS --format json`."""
    code, rows = cli_json(
        "query", "steps", "--store", str(store), "--run", run, *filters, "--format", "json"
    )
    assert code == 0
    return rows


def _faulty_steps(store: Path) -> list[dict]:
    rows = _steps(store, "synthetic", "--first-divergent-stage", "reward.post_process")
    assert rows
    return rows


def test_runs_page_lists_the_demo_runs(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    browser.get(f"{base}/")
    wait_for(browser, lambda d: len(elements(d, "td[data-field=steps]")) == len(web_demo.RUNS))
    rows = {row.get_attribute("data-run"): row for row in elements(browser, "#runs tr[data-run]")}
    assert set(rows) == set(web_demo.RUNS)
    for run, row in rows.items():
        steps = _steps(store, run)
        cell = row.find_element(By.CSS_SELECTOR, "td[data-field=diverged]")
        assert int(cell.text) == sum(step["status"] == "diverged" for step in steps)
        assert int(row.find_element(By.CSS_SELECTOR, "td[data-field=steps]").text) == len(steps)
    shoot(browser, shots, "runs")


def test_runs_page_stored_bytes_are_what_trajstore_stats_says(
    browser: WebDriver, base: str, store: Path
) -> None:
    """The bytes each run added to the store (issue 29 item 10), as `trajstore stats`
    counts them from the refs; the page draws them from the REST run summary."""
    code, stats = cli_json("stats", "--store", str(store), "--json")
    assert code == 0
    want = {r["run"]: r["physical_bytes"] for r in stats["runs"]}
    assert all(isinstance(n, int) and n > 0 for n in want.values()), want
    browser.get(f"{base}/")
    wait_for(browser, lambda d: len(elements(d, "td[data-field=stored]")) == len(web_demo.RUNS))
    got = {
        row.get_attribute("data-run"): int(
            row.find_element(By.CSS_SELECTOR, "td[data-field=stored]").get_attribute("data-bytes")
        )
        for row in elements(browser, "#runs tr[data-run]")
    }
    assert got == want


def test_filtering_by_first_divergent_stage_shows_exactly_the_faulty_rollouts_steps(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    browser.get(f"{base}/runs/synthetic")
    wait_for(browser, lambda d: elements(d, "#steps[data-loaded='1']"))
    stage = Select(browser.find_element(By.CSS_SELECTOR, "select[name=first_divergent_stage]"))
    stage.select_by_value("reward.post_process")
    browser.find_element(By.ID, "apply-filters").click()
    wait_for(
        browser,
        lambda d: (
            "first_divergent_stage=reward.post_process" in d.current_url
            and elements(d, "#steps[data-loaded='1']")
            and elements(d, "#strip svg")
        ),
    )
    rows = elements(browser, "#steps tr[data-step]")
    shown = [row.get_attribute("data-step") for row in rows]
    assert {int(step.split(":")[0]) for step in shown} == set(FAULT_ROLLOUTS)
    assert shown == [f"{r['rollout_id']}:{r['step_id']}" for r in _faulty_steps(store)]
    assert {row.get_attribute("data-stage") for row in rows} == {"reward.post_process"}
    marker = browser.find_element(By.CSS_SELECTOR, "#strip g.first-bad")
    assert int(marker.get_attribute("data-rollout")) == min(FAULT_ROLLOUTS)
    shoot(browser, shots, "steps")


def test_clicking_a_strip_bar_lists_the_steps_of_its_rollouts(
    browser: WebDriver, base: str, store: Path
) -> None:
    browser.get(f"{base}/runs/synthetic")
    wait_for(browser, lambda d: elements(d, "#strip rect.bin[data-worst=diverged]"))
    bar = elements(browser, "#strip rect.bin[data-worst=diverged]")[0]
    low, high = (int(bar.get_attribute(f"data-rollout-{end}")) for end in ("from", "to"))
    bar.click()
    wait_for(
        browser,
        lambda d: f"rollout_from={low}" in d.current_url and elements(d, "#steps[data-loaded='1']"),
    )
    shown = [row.get_attribute("data-step") for row in elements(browser, "#steps tr[data-step]")]
    want = _steps(store, "synthetic", "--rollout-from", str(low), "--rollout-to", str(high))
    assert shown == [f"{r['rollout_id']}:{r['step_id']}" for r in want]
    assert any(r["status"] == "diverged" for r in want)


def test_a_faulty_step_shows_the_divergence_naming_sample_and_token(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    step = _faulty_steps(store)[0]
    ref = f"{step['rollout_id']}:{step['step_id']}"
    browser.get(f"{base}/runs/synthetic?first_divergent_stage=reward.post_process")
    wait_for(browser, lambda d: elements(d, "#steps[data-loaded='1']"))
    browser.find_element(By.CSS_SELECTOR, f"#steps tr[data-step='{ref}'] a").click()
    wait_for(browser, lambda d: elements(d, "#divergences tr[data-stage]"))
    code, divergences = cli_json(
        "query", "divergences", "--store", str(store), "--run", "synthetic",
        "--rollout-from", str(step["rollout_id"]), "--rollout-to", str(step["rollout_id"]),
        "--format", "json",
    )  # fmt: skip
    assert code == 0
    mine = [d for d in divergences if d["step_id"] == step["step_id"]]
    first_token = next(d for d in mine if d["token_offset"] is not None)
    shown = {
        tuple(row.get_attribute(f"data-{name}") for name in ("stage", "sample", "token"))
        for row in elements(browser, "#divergences tr[data-stage]")
    }
    assert (
        first_token["stage"],
        first_token["sample_id"],
        str(first_token["token_offset"]),
    ) in shown
    assert len(shown) == len({(d["stage"], d["sample_id"], d["token_offset"]) for d in mine})
    failed = browser.find_element(By.CSS_SELECTOR, "#verdict tr[data-stage='reward.post_process']")
    assert failed.get_attribute("data-status") == "fail"
    shoot(browser, shots, "step")


def test_the_replay_button_shows_the_cli_verdict(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    step = _faulty_steps(store)[0]
    ref = f"{step['rollout_id']}:{step['step_id']}"
    browser.get(f"{base}/runs/synthetic/steps/{ref}")
    wait_for(browser, lambda d: elements(d, "#replay-button"))
    browser.find_element(By.ID, "replay-button").click()
    report = wait_for(browser, lambda d: elements(d, "#replay-report"))[0]
    cli = subprocess.run(
        [sys.executable, "-m", "trajstore", "replay", "--store", str(store)]
        + ["--run", "synthetic", "--step", ref, "--json"],
        capture_output=True,
        text=True,
    )
    want = json.loads(cli.stdout)
    assert int(report.get_attribute("data-exit-code")) == cli.returncode == 1
    assert report.get_attribute("data-status") == want["status"]
    assert report.get_attribute("data-first-divergent-stage") == want["first_divergent_stage"]
    first = want["first_divergence"]
    assert f"sample {first['sample_id']}" in report.text
    browser.execute_script("arguments[0].scrollIntoView()", report)
    shoot(browser, shots, "replay")


def test_the_replay_button_replays_one_group_as_the_cli_does(
    browser: WebDriver, base: str, store: Path
) -> None:
    step = _faulty_steps(store)[0]
    ref = f"{step['rollout_id']}:{step['step_id']}"
    browser.get(f"{base}/runs/synthetic/steps/{ref}")
    wait_for(browser, lambda d: len(elements(d, "#replay-group option")) > 1)
    group = Select(browser.find_element(By.ID, "replay-group"))
    name = group.options[1].get_attribute("value")
    group.select_by_value(name)
    browser.find_element(By.ID, "replay-button").click()
    report = wait_for(browser, lambda d: elements(d, "#replay-report"))[0]
    code, want = web_demo.cli(
        "replay",
        "--store",
        str(store),
        "--run",
        "synthetic",
        "--step",
        ref,
        "--group",
        name,
        "--json",
    )
    want = json.loads(want)
    assert int(report.get_attribute("data-exit-code")) == code
    assert report.get_attribute("data-status") == want["status"]
    assert report.get_attribute("data-first-divergent-stage") == (
        want["first_divergent_stage"] or ""
    )
    assert report.get_attribute("data-groups") == name
    assert want["selection"]["groups"] == [name]


def test_the_routes_page_draws_baseline_above_r3(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    browser.get(f"{base}/routes?run=baseline&run=r3")
    css = "figure[data-metric=route_mismatch_rate] circle.pt"
    wait_for(browser, lambda d: elements(d, css))
    drawn: dict[str, dict[str, tuple[float, float]]] = {"baseline": {}, "r3": {}}
    for point in elements(browser, css):
        drawn[point.get_attribute("data-run")][point.get_attribute("data-step")] = (
            float(point.get_attribute("cy")),
            float(point.get_attribute("data-value")),
        )
    code, cmp = cli_json(
        "router", "compare", "--store", str(store), "--run", "baseline", "--run", "r3", "--json"
    )
    assert code == 0
    for row in cmp["steps"]:
        step = f"{row['rollout_id']}:{row['step_id']}"
        for run in ("baseline", "r3"):
            assert drawn[run][step][1] == row["runs"][run]["route_mismatch_rate"]
        assert drawn["r3"][step][1] == 0 < drawn["baseline"][step][1]
        assert drawn["baseline"][step][0] < drawn["r3"][step][0]  # SVG y grows downwards
    assert set(drawn["baseline"]) == {f"{r['rollout_id']}:{r['step_id']}" for r in cmp["steps"]}
    shoot(browser, shots, "routes")


def test_the_diff_page_shows_the_first_differing_payload_sample_and_token(
    browser: WebDriver, base: str, store: Path, shots: Path
) -> None:
    resumed = next(step for step in _steps(store, "synthetic") if step["attempt"] == 2)
    ref = f"synthetic/{resumed['rollout_id']}:{resumed['step_id']}"
    browser.get(f"{base}/runs/{ref.replace('synthetic/', 'synthetic/steps/')}")
    wait_for(browser, lambda d: elements(d, "#diff-attempts"))
    browser.find_element(By.ID, "diff-attempts").click()
    box = wait_for(browser, lambda d: elements(d, "#first-payload-difference"))[0]
    code, diff = cli_json("diff", "--store", str(store), f"{ref}@1", f"{ref}@2", "--json")
    assert code == 1
    first = diff["first_payload_difference"]
    assert box.get_attribute("data-payload") == first["what"]
    assert box.get_attribute("data-sample") == first["sample_id"]
    assert box.get_attribute("data-token") == str(first["token_offset"])
    shoot(browser, shots, "diff")


def test_the_diff_page_says_why_when_a_payload_is_on_one_side_only(
    browser: WebDriver, base: str, store: Path
) -> None:
    # a step against its rollout: entropy and log_probs are the step's own; the box read
    # "entropy, sample -, token -: a = ..., b = ..." without saying what differs
    step = next(s for s in _steps(store, "synthetic") if s["attempt"] == 1)
    a, b = (
        f"synthetic/{step['rollout_id']}:{step['step_id']}",
        f"synthetic/rollout-{step['rollout_id']}",
    )
    browser.get(f"{base}/diff?a={a}&b={b}")
    box = wait_for(browser, lambda d: elements(d, "#first-payload-difference"))[0]
    code, diff = cli_json("diff", "--store", str(store), a, b, "--json")
    first = diff["first_payload_difference"]
    assert code == 1 and first["sample_id"] is None
    assert box.text == f"first differing payload: {first['what']}: {first['detail']}"


def _requests(driver: WebDriver) -> list[dict]:
    """Requests the page sent since the last call (Chrome's performance log)."""
    sent = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            sent.append(message["params"]["request"])
    return sent


def test_the_token_is_asked_once_and_sent_only_as_a_header(browser: WebDriver, store: Path) -> None:
    with web_demo.serve_here(store, token=TOKEN) as url:
        _requests(browser)  # drop what earlier tests sent
        browser.get(f"{url}/")
        wait_for(browser, lambda d: d.find_element(By.ID, "token-dialog").get_attribute("open"))
        browser.find_element(By.ID, "token-input").send_keys(TOKEN)
        browser.find_element(By.ID, "token-submit").click()
        wait_for(browser, lambda d: len(elements(d, "td[data-field=steps]")) == len(web_demo.RUNS))
        browser.find_element(By.CSS_SELECTOR, "#runs tr[data-run=synthetic] a").click()
        wait_for(browser, lambda d: elements(d, "#steps[data-loaded='1']"))
        assert browser.find_element(By.ID, "token-dialog").get_attribute("open") is None
        sent = [r for r in _requests(browser) if r["url"].startswith(url)]
    assert all(TOKEN not in r["url"] for r in sent)
    data = [r for r in sent if "/v1/" in r["url"]]
    with_token = [r for r in data if r["headers"].get("Authorization") == f"Bearer {TOKEN}"]
    assert len(data) - len(with_token) == 1  # only the first request, answered 401, lacked it
    assert any(r["url"].startswith(f"{url}/v1/runs/synthetic/steps") for r in with_token)


def test_the_api_docs_draw_every_operation_without_the_network(
    browser: WebDriver, base: str, shots: Path
) -> None:
    """/docs is Swagger UI with its script and styles served by the app (fastapi-offline's
    copies), not a CDN: with no host but the server's reachable it draws each operation of
    /openapi.json, and every request the page sent went to the server."""
    spec = httpx.get(f"{base}/openapi.json", timeout=60).json()
    operations = sorted(
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    )
    assert len(operations) >= 15
    _requests(browser)  # drop what earlier tests sent
    browser.get(f"{base}/docs")
    wait_for(browser, lambda d: len(elements(d, ".opblock")) >= len(operations))
    drawn = sorted(
        (
            block.find_element(By.CSS_SELECTOR, ".opblock-summary-method").text,
            block.find_element(By.CSS_SELECTOR, ".opblock-summary-path").get_attribute("data-path"),
        )
        for block in elements(browser, ".opblock")
    )
    assert drawn == operations
    sent = [r["url"] for r in _requests(browser) if not r["url"].startswith("data:")]
    assert f"{base}/openapi.json" in sent
    assert all(url.startswith(f"{base}/") for url in sent), sent
    shoot(browser, shots, "api-docs")

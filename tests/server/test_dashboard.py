"""GET /dashboard and /dashboard/data against a live tiny server, the page driven by a real headless
chromium (Debian's `chromium` + `chromium-driver`, through selenium with an explicit driver path:
never Selenium Manager, whose downloads cannot be fetched here).

The browser test puts the server under load from a few threads, checks every chart of the page
drew at least 2 points, then, once idle, that the page's counters equal `/metrics` and
`/dashboard/data`; it saves screenshots (under load, and idle) to the test's tmp dir, and the one under load to
docs/dashboard.png when that file is missing (the README shows it).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aserve.core.stats import SchedulerStats
from aserve.engine.stats import IterationStats
from aserve.server.dashboard import DashboardStats, percentile
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)
KEY = "dash-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
CHARTS = ("chart-kv", "chart-queues", "chart-throughput", "chart-ttft", "chart-itl", "chart-prefix")
# the page's counter element id -> the Prometheus counter (after "vllm:") it must equal
COUNTERS = {
    "total-generation_tokens": "generation_tokens_total",
    "total-prompt_tokens": "prompt_tokens_total",
    "total-num_preemptions": "num_preemptions_total",
    "total-prefix_cache_hits": "prefix_cache_hits_total",
    "total-requests_succeeded": "request_process_success_total",
}
SHARED_PREFIX = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A tiny server with an API key and a small KV pool (so the load preempts)."""
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny"))
    with serving(model, quiet_args(api_key=KEY), num_gpu_blocks_override=24, block_size=8) as (engine, address):
        yield engine, address.url


def _scrape(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {s.name.removeprefix("vllm:"): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("vllm:") and not s.labels.keys() - {"model_name", "engine"}}


def _complete(url: str, i: int, max_tokens: int = 60) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": f"{SHARED_PREFIX} request {i}", "max_tokens": max_tokens,
                                               "ignore_eos": True, "temperature": 0.8})
        assert r.status_code == 200, r.text


def test_stats_buckets_latency_and_window():
    now = [1000.2]
    stats = DashboardStats(window_s=5, clock=lambda: now[0], wall=lambda: 50.0)
    for step in range(8):
        now[0] = 1000.2 + step
        stats.record(SchedulerStats(num_running_reqs=step, num_used_blocks=4, num_total_blocks=10,
                                    num_cached_free_blocks=2, prefix_cache_queries=10, prefix_cache_hits=5,
                                    num_preemptions=1),
                     IterationStats(num_prompt_tokens=3, num_generation_tokens=7,
                                    time_to_first_tokens=[0.1 * (step + 1)], inter_token_latencies=[0.01, 0.03]))
        stats.record(SchedulerStats(num_running_reqs=step), IterationStats(num_generation_tokens=1))
    series = stats.series()
    assert len(series) == 5  # the window keeps the last 5 seconds
    last = series[-1]
    assert last["generation_tps"] == 8 and last["prompt_tps"] == 3 and last["running"] == 7
    assert last["ttft_p50"] == pytest.approx(0.8) and last["itl_p99"] == 0.03 and last["prefix_hit_rate"] == 0.5
    assert last["preemptions"] == 1 and -1 < last["t"] <= 0
    latency = stats.latency()
    assert latency["ttft"]["count"] == 5 and latency["itl"]["count"] == 10
    assert latency["ttft"]["p50"] == pytest.approx(0.6) and latency["itl"]["p90"] == 0.03
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_data_needs_the_key_and_has_the_documented_shape(live):
    _engine, url = live
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/dashboard/data").status_code == 401
        assert http.get("/dashboard").status_code == 401
        assert http.get("/dashboard?key=wrong").status_code == 401
        page = http.get(f"/dashboard?key={KEY}")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["referrer-policy"] == "no-referrer"  # the polls never carry ?key= in a Referer
        assert "<svg" in page.text and "http" not in page.text.split("<script>")[1].split("SVG =")[0]

        secret_prompt = "zebra quick fox"
        done = threading.Event()
        status: list[int] = []

        def stream() -> None:
            with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
                r = c.post("/v1/completions", json={"prompt": secret_prompt, "max_tokens": 80, "ignore_eos": True})
                status.append(r.status_code)
            done.set()

        worker = threading.Thread(target=stream)
        worker.start()
        seen = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not done.is_set():
            r = http.get("/dashboard/data", headers=AUTH)
            assert r.status_code == 200
            if r.json()["requests"]:
                seen = r
                break
            time.sleep(0.02)
        worker.join()
        assert status == [200]
        assert seen is not None, "the in-flight request never showed"
        assert "zebra" not in seen.text
        req = seen.json()["requests"][0]
        assert set(req) == {"id", "state", "prompt_tokens", "output_tokens", "age_s"}
        assert req["state"] in ("waiting", "running") and req["prompt_tokens"] > 0 and req["age_s"] >= 0

        data = http.get("/dashboard/data", headers=AUTH).json()
        assert set(data) == {"model", "window_s", "kv", "queues", "totals", "latency", "series", "requests"}
        kv = data["kv"]
        assert kv["num_used_blocks"] + kv["num_cached_blocks"] + kv["num_free_blocks"] == kv["num_total_blocks"] == 23
        assert kv["num_cached_blocks"] > 0  # the finished request's full blocks stay cached
        assert data["queues"] == {"running": 0, "waiting": 0, "swapped": 0} and data["requests"] == []
        assert data["latency"]["ttft"]["count"] >= 1 and data["latency"]["itl"]["p50"] > 0
        assert data["series"] and all(p["t"] <= 0 for p in data["series"])
        scraped = _scrape(http)
        assert data["totals"]["generation_tokens"] == scraped["generation_tokens_total"] >= 80


def _chrome():
    if not (shutil.which("chromium") or Path(CHROMIUM).exists()) or not Path(CHROMEDRIVER).exists():
        pytest.skip(f"no headless browser: {CHROMIUM} and {CHROMEDRIVER} are needed "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or CHROMIUM
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_page_in_a_headless_browser_under_load(live, tmp_path):
    _engine, url = live
    driver = _chrome()
    try:
        from selenium.webdriver.common.by import By

        driver.get(f"{url}/dashboard?key={KEY}")

        def polls() -> int:
            return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0)

        _wait(lambda: polls() >= 1, 30, "the page's first poll")
        assert "key=" not in driver.current_url  # the key left the address bar (and the history)

        stop = time.monotonic() + 10
        counter = iter(range(10**6))
        lock = threading.Lock()
        errors: list[BaseException] = []

        def client() -> None:
            try:
                while time.monotonic() < stop:
                    with lock:
                        i = next(counter)
                    _complete(url, i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(5)
        in_flight = driver.find_element(By.ID, "num-requests").text
        under_load = tmp_path / "dashboard-under-load.png"
        assert driver.save_screenshot(str(under_load))
        for t in threads:
            t.join()
        assert not errors, errors
        assert int(in_flight) > 0, "the page showed no in-flight request under load"

        # idle now: two more polls, so the page shows the final counters
        after = polls()
        _wait(lambda: polls() >= after + 2, 30, "two polls after the load")
        points = {c: int(driver.find_element(By.ID, c).get_attribute("data-points") or 0) for c in CHARTS}
        assert all(n >= 2 for n in points.values()), points

        with httpx.Client(base_url=url, timeout=60) as http:
            scraped = _scrape(http)
            data = http.get("/dashboard/data", headers=AUTH).json()
        shown = {elem: driver.find_element(By.ID, elem).get_attribute("data-value") for elem in COUNTERS}
        for elem, metric in COUNTERS.items():
            assert float(shown[elem]) == scraped[metric], (elem, shown[elem], scraped[metric])
            assert float(shown[elem]) == data["totals"][elem.removeprefix("total-")]
        assert scraped["generation_tokens_total"] > 0 and scraped["prefix_cache_hits_total"] > 0
        assert scraped["num_preemptions_total"] > 0, "the small KV pool should have preempted"
        for elem in ("queue-running", "queue-waiting", "kv-num_used_blocks"):
            assert driver.find_element(By.ID, elem).get_attribute("data-value") == "0"

        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if not DOCS_SHOT.exists():  # once, for the README
            DOCS_SHOT.parent.mkdir(exist_ok=True)
            shutil.copyfile(under_load, DOCS_SHOT)
    finally:
        driver.quit()

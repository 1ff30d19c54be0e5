"""/metrics as Prometheus itself reads it: the page of a real server (`python -m engine_core.entrypoints.openai`)
passes Prometheus's linter (`promtool check metrics`), and a real Prometheus server scraping it stores every
sample with the value the page reports.

promtool and prometheus come from Debian's `prometheus` package, which `.ci/run` installs; where they are absent
the tests that need them skip and say so. Nothing of Prometheus's own service is used: the scraping test starts
its own server on a free loopback port with a temporary config and storage, and kills it.
"""
from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import fields
from pathlib import Path

import httpx2
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import Server, free_port
from engine_core.entrypoints.openai.api_server import ServerMetrics
from engine_core.metrics import Stats
from engine_core.presets import preset_path

pytestmark = pytest.mark.timeout(240)
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; "
                                                             ".ci/run installs it)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package "
                                                                 "`prometheus`; .ci/run installs it)")
# vLLM's names carry a colon ("vllm:..."): Prometheus's data model allows it, its linter reserves colons for
# recording rules by convention and says so for every name. That finding alone is accepted; any other fails.
COLON = "metric names should not contain ':'"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled by position: no series before a draft
PROMPT, MAX_TOKENS = "Hello, my name is", 3
DEADLINE_S = 90.0


def promtool_problems(text: str) -> list[str]:
    """What `promtool check metrics` finds in `text` (parse errors and lint findings), less the colon finding."""
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (done.stdout + done.stderr).splitlines() if line.strip() and COLON not in line]
    if done.returncode not in (0, 3):  # 3: lint findings only (checked above); anything else is a failure
        problems.append(f"promtool exited {done.returncode}")
    return problems


def families(text: str) -> list[str]:
    """The metric names of a text exposition's `# TYPE` lines, in order, repeats kept."""
    return [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]


def kit_names() -> set[str]:
    """Every metric the kit exports: the engine's (declared on `Stats`) and the server's own."""
    engine = {f.metadata["prometheus"] for f in fields(Stats) if f.metadata.get("prometheus")}
    return engine | {"vllm:num_preemptions_total"} | set(families(generate_latest(ServerMetrics().registry).decode()))


def test_engine_and_server_export_disjoint_metrics():
    """The page is the engine's text followed by the server's registry: no name may be in both (a second
    `# TYPE` line for a name makes the whole page invalid exposition)."""
    engine, server = families(Stats().to_prometheus()), families(generate_latest(ServerMetrics().registry).decode())
    page = engine + server
    assert len(page) == len(set(page)), sorted({n for n in page if page.count(n) > 1})
    assert set(page) == kit_names()


@needs_promtool
def test_promtool_accepts_the_engine_text_with_every_series():
    """Every family with samples, the per-position draft counter and the histograms included."""
    stats = Stats()
    stats.observe_drafts(3, 2)
    stats.itl.observe(0.02)
    stats.ttft.observe(0.3)
    stats.tpot.observe(0.05)
    assert f'{PER_POS}{{position="1"}} 1.0' in stats.to_prometheus()
    assert promtool_problems(stats.to_prometheus()) == []


@needs_promtool
def test_promtool_flags_what_it_should():
    """The check can fail: a repeated family and a counter without `_total` are both reported."""
    text = Stats().to_prometheus()
    assert any("second HELP line" in p for p in promtool_problems(text + text))
    assert any('"_total" suffix' in p for p in promtool_problems(text.replace(PER_POS, PER_POS[:-len("_total")])
                                                                 + f'{PER_POS[:-len("_total")]}{{position="0"}} 1\n'))


@pytest.fixture(scope="module")
def served():
    """A server that has answered one greedy completion of MAX_TOKENS tokens and is idle; its prompt's length."""
    srv = Server(str(preset_path("tiny-llama")))
    try:
        srv.client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        num_prompt = httpx2.post(f"{srv.url}/tokenize", json={"model": "m", "prompt": PROMPT}, timeout=30).json()
        srv.wait_idle()
        yield srv, num_prompt["count"]
    finally:
        srv.stop()


@needs_promtool
def test_promtool_accepts_a_live_server_page(served):
    srv, _ = served
    text = httpx2.get(f"{srv.url}/metrics", timeout=30).text
    assert set(families(text)) == kit_names()
    assert promtool_problems(text) == []


def _sample_key(name: str, labels: dict[str, str]) -> tuple:
    return (name, tuple(sorted((k, v) for k, v in labels.items() if k not in ("__name__", "job", "instance"))))


def _stored(url: str) -> dict[tuple, float]:
    """Every `vllm:` series Prometheus holds now (job and instance labels dropped) -> its latest value."""
    reply = httpx2.get(f"{url}/api/v1/query", params={"query": '{__name__=~"vllm:.+", job="engine"}'}, timeout=10)
    reply.raise_for_status()
    return {_sample_key(r["metric"]["__name__"], r["metric"]): float(r["value"][1])
            for r in reply.json()["data"]["result"]}


@pytest.fixture
def prometheus(served, tmp_path):
    """A Prometheus server of its own scraping `served` every second: its URL."""
    srv, _ = served
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                      f"  - job_name: engine\n    static_configs:\n      - targets: ['127.0.0.1:{srv.port}']\n")
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.kill()
        proc.wait(10)


def _wait_stored(url: str, proc: subprocess.Popen, log: Path, expected: dict[tuple, float]) -> dict[tuple, float]:
    """Poll Prometheus's query API until it holds every expected sample with its value (or fail at the deadline)."""
    deadline, stored = time.monotonic() + DEADLINE_S, {}
    while True:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()[-3000:]}"
        try:
            stored = _stored(url)
        except httpx2.HTTPError:  # not listening yet, or not ready
            pass
        if all(stored.get(key) == value for key, value in expected.items()):
            return stored
        if time.monotonic() > deadline:
            wrong = {k: (v, stored.get(k)) for k, v in expected.items() if stored.get(k) != v}
            raise AssertionError(f"after {DEADLINE_S} s Prometheus lacks or differs on {len(wrong)} samples "
                                 f"(page, stored): {dict(list(wrong.items())[:10])}\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


@needs_prometheus
def test_a_real_prometheus_scrapes_every_metric_with_its_value(served, prometheus):
    srv, num_prompt = served
    url, proc, log = prometheus
    text = httpx2.get(f"{srv.url}/metrics", timeout=30).text
    expected = {_sample_key(sample.name, sample.labels): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}
    stored = _wait_stored(url, proc, log, expected)
    names = {key[0] for key in stored}
    for name in kit_names() - {PER_POS}:
        assert any(n == name or n.startswith(name + "_") for n in names), f"{name}: no series in Prometheus"
    # what one completion of MAX_TOKENS greedy tokens must have counted, read back from Prometheus
    assert stored[("vllm:generation_tokens_total", ())] == MAX_TOKENS
    assert stored[("vllm:prompt_tokens_total", ())] == num_prompt
    assert stored[("vllm:request_success_total", (("finished_reason", "length"),))] == 1
    assert stored[("vllm:time_to_first_token_seconds_count", ())] == 1
    assert stored[("vllm:inter_token_latency_seconds_count", ())] == MAX_TOKENS - 1
    assert stored[("vllm:num_requests_running", ())] == 0


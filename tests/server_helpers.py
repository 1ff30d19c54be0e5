"""Real servers for the serving tests: the OpenAI server and the router as subprocesses on free
loopback ports, each in its own session, waited on through `/health`; `stop()` checks nothing of
the session is left."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
from prometheus_client.parser import text_string_to_metric_families

from engine_core.presets import preset_path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--device", "cpu", "--num-gpu-blocks", "128"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_model(where: Path) -> Path:
    """tiny-llama's folder copied under `where` with a chat template added (the preset has none)."""
    folder = where / "tiny-llama-chat"
    shutil.copytree(preset_path("tiny-llama"), folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """`python -m MODULE ARGS --host 127.0.0.1 --port P` in its own session, healthy within `startup_s`."""

    def __init__(self, module: str, *args: str, startup_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
                                      *args], cwd=ROOT, env=env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while True:
            assert self.proc.poll() is None, f"{module} exited: {self.proc.stdout.read().decode()[-3000:]}"
            try:
                if httpx2.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{module} not healthy after {startup_s} s")
            time.sleep(0.25)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus_client's parser (labels in braces)."""
        text = httpx2.get(f"{self.url}/metrics", timeout=10).text
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def kill(self) -> None:
        """SIGKILL the whole session at once (a crash), reaped."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGINT, then wait until nothing of the server's session is left: an orphaned resource tracker may stay
        a zombie for a moment, until the machine's init reaps it (so no single check right after the exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        assert self.proc.returncode is not None
        deadline = time.monotonic() + 60
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            assert time.monotonic() < deadline, "a process of the server's session outlived it by 60 s"
            time.sleep(0.05)


class Server(Process):
    """The OpenAI-compatible server (`python -m engine_core.entrypoints.openai`) on the CPU."""

    def __init__(self, model: str, *args: str, name: str = "m") -> None:
        super().__init__("engine_core.entrypoints.openai", "--model", model, "--served-model-name", name,
                         *ENGINE_ARGS, *args)

    def wait_idle(self, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0 \
                    and m["vllm:kv_cache_usage_perc"] == 0:
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout}s: running {m['vllm:num_requests_running']}"
            time.sleep(0.05)

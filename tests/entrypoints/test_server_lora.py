"""The OpenAI server's `--lora-modules NAME=PATH` (vLLM's flag): a request whose `model` names an adapter runs it,
the base name runs the base model, both in one server; the adapters are listed by /v1/models; an unknown name is a
404 and bad flags are refused at start. Tokens are compared with `LLM.generate` greedy on the same adapter."""
from __future__ import annotations

import re
import subprocess
import sys

import openai
import pytest

from server_helpers import ROOT, Server
from engine_core import LLM, LoRARequest, SamplingParams
from engine_core.lora.presets import adapter_path

pytestmark = pytest.mark.timeout(180)
PROMPT = [1, 5, 9, 44, 7, 300, 2]


@pytest.fixture(scope="module")
def server():
    srv = Server("tiny-llama", "--enable-lora", "--max-lora-rank", "16",
                 "--lora-modules", f"r8={adapter_path('tiny-llama', 'r8-attn')}",
                 f"r16={adapter_path('tiny-llama', 'r16-all')}", name="base")
    yield srv
    srv.stop()


def _offline(adapter: str | None) -> list[int]:
    llm = LLM("tiny-llama", enable_lora=True, max_lora_rank=16, device="cpu", num_gpu_blocks=128)
    lora = None if adapter is None else LoRARequest(adapter, 1, str(adapter_path("tiny-llama", adapter)))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False,
                       lora_request=lora)
    return out[0].outputs[0].token_ids


def _served(server, model: str) -> list[int]:
    out = server.client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].token_ids


def test_each_name_runs_its_adapter_and_the_base_stays_the_base(server):
    served = {m: _served(server, m) for m in ("base", "r8", "r16")}
    assert served == {"base": _offline(None), "r8": _offline("r8-attn"), "r16": _offline("r16-all")}
    assert len({tuple(t) for t in served.values()}) == 3  # the adapters change this prompt's tokens
    assert [m.id for m in server.client.models.list().data] == ["base", "r8", "r16"]


def test_an_unknown_adapter_is_a_404_naming_the_served_ones(server):
    with pytest.raises(openai.NotFoundError, match=r"`r64` does not exist .*`base`, `r8`, `r16`"):
        server.client.completions.create(model="r64", prompt=PROMPT, max_tokens=2)


@pytest.mark.parametrize("args, match", [
    (["--lora-modules", "x=/nonexistent"], r"--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "x"], r"--lora-modules takes NAME=PATH"),
    (["--enable-lora", "--lora-modules", "x=/nonexistent"], r"an existing folder, got 'x=/nonexistent'"),
])
def test_bad_flags_are_refused_at_start(args, match):
    done = subprocess.run([sys.executable, "-m", "engine_core.entrypoints.openai", "--model", "tiny-llama", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and re.search(match, done.stderr), done.stderr[-800:]

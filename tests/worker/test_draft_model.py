"""Method "draft_model" where its distribution is decided: the rejection sampler's wrapper with a draft
model's q (drafts drawn from q, accepted with min(1, p/q), the residual on rejection) emits the target's
p, by the chi-squared check of test_rejection_sampler.py; and the draft model's q is its own softmax after
the request's temperature and top-k, its greedy drafts its argmax chain."""
from __future__ import annotations

import torch
import transformers
from test_rejection_sampler import ALPHA, chi2_pvalue

from engine_core.models.config import ModelConfig
from engine_core.presets import preset_path
from engine_core.request import Request, SamplingParams
from engine_core.worker.draft_model import DraftModel
from engine_core.worker.rejection_sampler import RejectionSampler
from engine_core.worker.sampler import Sampler


def test_the_wrapper_with_draft_probs_emits_the_targets_distribution():
    """Two drafts from a q far from p at T = 0.8: the first emitted token follows p_0, the token after an
    accepted first draft follows p_1, and the first draft is accepted with probability sum min(p_0, q_0)."""
    n, V = 20_000, 5
    g = torch.Generator().manual_seed(7)
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 2.0, 1.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    p = (rows.double() / 0.8).softmax(-1)
    q = torch.tensor([[0.05, 0.1, 0.2, 0.3, 0.35], [0.4, 0.1, 0.1, 0.2, 0.2]])
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(2)], 1).tolist()
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(temperature=0.8)) for i in range(n)]
    tokens = RejectionSampler(Sampler(0))(rows.repeat(n, 1), reqs, drafts, [q] * n)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V)
    assert chi2_pvalue(first, p[0] * n) > ALPHA, (first, p[0] * n)
    second = torch.tensor([t[1] for t in tokens if len(t) > 1])
    assert chi2_pvalue(torch.bincount(second, minlength=V), p[1] * len(second)) > ALPHA
    alpha = float(torch.minimum(p[0], q[0].double()).sum())
    accepted = sum(len(t) > 1 for t in tokens)
    assert abs(accepted / n - alpha) < 5 * (0.25 / n) ** 0.5, (accepted / n, alpha)


def _drafter(config: ModelConfig) -> DraftModel:
    """A drafter with its own paged cache: 64 blocks of 4 slots, request i in blocks 16i..16i+15."""
    drafter = DraftModel(config, 3, torch.float32, torch.device("cpu"), 64, 4, "torch")
    drafter.allocate(64)
    return drafter


def _tables(n: int) -> torch.Tensor:
    return torch.arange(16 * n, dtype=torch.int32).reshape(n, 16)


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_the_draft_models_q_and_greedy_chain_are_its_own():
    config = ModelConfig.load(preset_path("tiny-llama-draft"))
    drafter = _drafter(config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32).eval()
    prompt = [5, 9, 17, 33, 65]
    greedy = Request("g", prompt, SamplingParams(temperature=0.0))
    sampled = Request("s", prompt, SamplingParams(temperature=0.7, top_k=4, seed=3))
    with torch.inference_mode():
        (chain, tokens), (none, q) = drafter.propose([greedy, sampled], [3, 2], _tables(2), Sampler(0))
        expected = []
        for _ in range(3):
            expected.append(int(_hf_logits(hf, prompt + expected).argmax()))
        assert chain == expected and none is None
        for j in range(2):
            logits = _hf_logits(hf, prompt + tokens[:j]) / 0.7
            top = logits.topk(4).indices
            ref = torch.full_like(logits, float("-inf")).index_fill(0, top, 0) + logits
            torch.testing.assert_close(q[j], ref.softmax(-1), rtol=1e-5, atol=1e-6)
            assert int(tokens[j]) in top.tolist()  # drawn from q: inside its top-k support
    drafter.forget(["s"])
    again = drafter.propose([sampled], [2], _tables(1), Sampler(5))[0][0]
    assert again == tokens  # a seeded request drafts the same tokens whatever the engine's generator


def test_tiny_llama_draft_is_tiny_llamas_first_layer():
    """The preset's claim (engine_core/presets.py): the same embedding, layer 0 and LM head as tiny-llama,
    so its drafts are a real self-draft (some accepted), not noise."""
    from safetensors.torch import load_file

    from engine_core.presets import resolve_model

    draft = load_file(resolve_model("tiny-llama-draft") / "model.safetensors")
    target = load_file(resolve_model("tiny-llama") / "model.safetensors")
    assert not any(k.startswith("model.layers.1.") for k in draft)
    same = [k for k in draft if k != "model.norm.weight"]
    assert same and all(torch.equal(draft[k], target[k]) for k in same)


def test_one_batched_draft_forward_equals_each_request_alone_after_rollbacks():
    """Three requests of different lengths in one batch, step after step, each with some drafts rejected
    (a token the draft did not propose appended): the drafts from the shared forward over the kept,
    rolled-back cache are the ones a fresh drafter computes for each request alone from its tokens."""
    config = ModelConfig.load(preset_path("tiny-llama-draft"))
    kept = _drafter(config)
    requests = [Request(f"r{i}", prompt, SamplingParams(temperature=0.0))
                for i, prompt in enumerate([[5, 9, 17, 33, 65], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9]])]
    for step in range(4):
        counts = [3, 1 + step % 3, 2]
        drafts = kept.propose(requests, counts, _tables(3), Sampler(0))[0]
        for i, request in enumerate(requests):
            fresh = _drafter(config).propose([request], [counts[i]], _tables(1), Sampler(0))[0][0]
            assert drafts[i] == fresh, (step, i)
            accepted = drafts[i][:(step + i) % (counts[i] + 1)]  # 0..all drafts accepted, then the target's token
            for token in [*accepted, (drafts[i][len(accepted) % counts[i]] + 1) % 512]:
                request.append_token(token, 0.0)
    kept.forget([r.request_id for r in requests])
    assert not kept.cached

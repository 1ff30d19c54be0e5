"""The sampler: greedy is argmax, sampling follows softmax(logits / T) restricted to top-k / top-p,
and a seeded request gets the same tokens whatever else shares its batch."""
from __future__ import annotations

import torch

from engine_core import LLM, SamplingParams
from engine_core.request import Request
from engine_core.worker.sampler import Sampler


def _reqs(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert Sampler(0)(logits, _reqs(6, temperature=0.0)) == logits.argmax(-1).tolist()


def test_sampling_follows_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    n = 20000
    tokens = Sampler(0)(logits.expand(n, 5), _reqs(n, temperature=0.7))
    expected = (logits[0].double() / 0.7).softmax(-1)
    # each frequency has std <= sqrt(0.25 / n) = 0.0035; 0.02 is over 5 sigma
    assert torch.allclose(_frequencies(tokens, 5), expected, atol=0.02), (_frequencies(tokens, 5), expected)


def test_top_k_and_top_p_restrict_then_renormalise():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]])
    n = 20000
    tokens = Sampler(1)(logits.expand(n, 6), _reqs(n, temperature=1.0, top_k=3))
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:3] = logits[0, :3].double().softmax(-1)
    assert torch.allclose(_frequencies(tokens, 6), expected, atol=0.02)
    # top_p: the smallest prefix (by probability) whose mass reaches p
    p = logits[0].double().softmax(-1)
    top_p = float(p[0] + p[1]) - 1e-3  # tokens 0 and 1 are needed to reach it, token 2 is not
    tokens = Sampler(2)(logits.expand(n, 6), _reqs(n, temperature=1.0, top_p=top_p))
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:2] = p[:2] / p[:2].sum()
    assert torch.allclose(_frequencies(tokens, 6), expected, atol=0.02)


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    assert Sampler(0)(logits, _reqs(8, temperature=5.0, top_k=1)) == logits.argmax(-1).tolist()
    assert Sampler(0)(logits, _reqs(8, temperature=5.0, top_p=1e-6)) == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    reqs = _reqs(2, temperature=0.0) + _reqs(2, temperature=1.0)
    out = Sampler(0)(logits, reqs)
    assert out[:2] == logits[:2].argmax(-1).tolist()


def test_seeded_row_is_independent_of_its_neighbours():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    alone = Request("s", [1], SamplingParams(temperature=1.0, seed=7))
    crowd = _reqs(2, temperature=1.0) + [Request("s", [1], SamplingParams(temperature=1.0, seed=7))] \
        + _reqs(2, temperature=0.5, seed=9)
    a, b = [], []
    for _ in range(10):  # ten positions: each token is appended before the next draw
        a.append(Sampler(0)(logits[2:3], [alone])[0])
        b.append(Sampler(123)(logits, crowd)[2])
        alone.output_token_ids.append(a[-1])
        crowd[2].output_token_ids.append(b[-1])
    assert a == b
    assert len(set(a)) > 1, "10 draws at temperature 1 over 64 tokens should not all be equal"


def test_a_seeded_draw_depends_only_on_seed_and_position():
    """So a request recomputed after preemption, or after a step that failed before its token was
    appended, draws exactly the token an uninterrupted run draws."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    request = Request("s", [1], SamplingParams(temperature=1.0, seed=7))
    twin = Request("t", [1, 2, 3], SamplingParams(temperature=1.0, seed=7))  # another id and prompt, same seed
    sampler = Sampler(0)
    for _ in range(8):
        again = {sampler(logits, [request])[0] for _ in range(3)}  # a draw repeated at one position
        assert len(again) == 1
        request.output_token_ids.append(again.pop())
        twin.output_token_ids.append(Sampler(99)(logits, [twin])[0])
    assert request.output_token_ids == twin.output_token_ids and len(set(request.output_token_ids)) > 1


def test_seeded_requests_give_the_same_tokens_whatever_shares_the_batch():
    """End to end: the same seeded request alone, and amid other (seeded and unseeded) requests."""
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=42, ignore_eos=True)
    prompt = list(range(10, 30))
    alone = LLM("tiny-llama", num_gpu_blocks=64, seed=1).generate([prompt], seeded, use_tqdm=False)
    others = [[5] * n for n in (3, 40, 7)]
    params = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.2, seed=3, ignore_eos=True)]
    crowd = LLM("tiny-llama", num_gpu_blocks=64, seed=2, max_num_batched_tokens=16).generate(
        [others[0], prompt, others[1], others[2]], [params[0], seeded, params[1], params[2]], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids

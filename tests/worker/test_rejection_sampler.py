"""The rejection sampler keeps the target distribution exactly, shown by a test that can fail.

For known target rows p_0, p_1, p_2 and draft distributions q_1, q_2 (None: a fixed, one-hot draft, as
n-gram drafts are), N independent verify steps of k = 2 drafts drawn from q. Speculative sampling is exact
when (a) the first emitted token is distributed as p_0, (b) after an accepted first draft the next token is
distributed as p_1, (c) after two accepted drafts the bonus token as p_2, and (d) the number of tokens
emitted is 1, 2, 3 with the probabilities 1 - a_1, a_1 (1 - a_2), a_1 a_2, where a_j = sum_x min(p, q) is
the acceptance rate (1 - a_j is the total-variation distance of p and q). Each is a chi-squared test in
float64 whose p-value must exceed ALPHA. Planted wrong samplers in this file (inverse-CDF sampling, so a
missing normalisation matters) fail at the same N: the test has the power to see the bugs it is for.

Not planted: accepting when u < p/q uncapped. That is the same event as u < min(1, p/q) (u < 1), so it
is no bug; the planted acceptance bug uses q/p instead.
"""
from __future__ import annotations

import pytest
import torch

from engine_core.request import Request, SamplingParams
from engine_core.worker.rejection_sampler import PLACEHOLDER, RejectionSampler, greedy_verify, rejection_sample
from engine_core.worker.sampler import Sampler

N = 50_000  # at this size every planted bug's p-value underflows to 0; the real sampler's stay above ALPHA
V = 6
K = 2
ALPHA = 1e-6  # false alarm chance per check; a planted bug's p-value is far below it (asserted)


def dist(*w: float) -> torch.Tensor:
    t = torch.tensor(w, dtype=torch.float64)
    return t / t.sum()


def _random_pair(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.rand(V, generator=g, dtype=torch.float64) ** 2 for _ in range(5)]
    rows = [r / r.sum() for r in rows]
    return rows[:3], rows[3:]


P = [dist(4, 3, 2, 1, 0.5, 0.5), dist(1, 1, 6, 1, 0.5, 0.5), dist(0.2, 2, 2, 3, 1, 1)]
CASES = {
    "disjoint supports": ([dist(1, 2, 3, 0, 0, 0)] * 3, [dist(0, 0, 0, 1, 1, 2)] * 2),
    "q = p": (P, P[:2]),
    "q uniform": (P, [dist(*[1] * V)] * 2),
    "one-hot q (n-gram)": (P, None),
    "random pair 1": _random_pair(1),
    "random pair 2": _random_pair(2),
}
ONE_HOT_DRAFTS = (0, 2)  # the fixed drafts of the one-hot case: likely tokens under p_0 and p_1


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P(chi2 >= the statistic) with df = categories with expected > 0, minus 1 (float64). A category
    expected empty but observed is an impossible outcome: p-value 0."""
    observed, expected = observed.double(), expected.double()
    if bool(((expected == 0) & (observed > 0)).any()):
        return 0.0
    keep = expected > 0
    df = int(keep.sum()) - 1
    if df < 1:
        return 1.0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draws(p: list[torch.Tensor], q: list[torch.Tensor] | None, seed: int):
    """N verify steps: target rows [N, K+1, V], drafts [N, K] drawn from q, draft probs or None, uniforms
    [N, K], Exp(1) noise [N, K+1, V]."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack(p).expand(N, K + 1, V)
    if q is None:
        drafts = torch.tensor(ONE_HOT_DRAFTS).expand(N, K)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(qj, N, replacement=True, generator=g) for qj in q], dim=1)
        draft_probs = torch.stack(q).expand(N, K, V)
    uniforms = torch.rand(N, K, generator=g, dtype=torch.float64)
    noise = torch.empty(N, K + 1, V, dtype=torch.float64).exponential_(generator=g)
    return target, drafts, draft_probs, uniforms, noise


def pvalues(sampler, p: list[torch.Tensor], q: list[torch.Tensor] | None, seed: int = 0) -> dict[str, float]:
    """The four checks' p-values for one sampler on one (p, q)."""
    target, drafts, draft_probs, uniforms, noise = draws(p, q, seed)
    out = sampler(target, drafts, torch.full((N,), K), uniforms, noise, draft_probs)
    length = (out != PLACEHOLDER).sum(dim=1)
    qs = [torch.nn.functional.one_hot(torch.tensor(d), V).double() for d in ONE_HOT_DRAFTS] if q is None else q
    a = [float(torch.minimum(p[j], qs[j]).sum()) for j in range(K)]
    expected_len = torch.tensor([1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]], dtype=torch.float64) * N
    result = {"length": chi2_pvalue(torch.bincount(length - 1, minlength=K + 1)[:K + 1], expected_len)}
    for j in range(K + 1):
        rows = out[length > j, j]
        if float(expected_len[j:].sum()) >= 1000:  # enough samples to test the token's distribution
            result[f"token {j}"] = chi2_pvalue(torch.bincount(rows, minlength=V), p[j] * len(rows))
    return result


# ---- the engine's sampler and the planted wrong ones ---------------------------------------------------------

def planted(bug: str | None):
    """Speculative sampling written again with inverse-CDF draws (`bug` None: correct), one bug planted."""
    def sample(target, drafts, num_draft, uniforms, noise, draft_probs):
        B = drafts.shape[0]
        rows = torch.arange(B)
        q = torch.nn.functional.one_hot(drafts, V).double() if draft_probs is None else draft_probs
        p_d = target[:, :K].gather(2, drafts[..., None])[..., 0]
        q_d = q.gather(2, drafts[..., None])[..., 0]
        ratio = q_d / p_d.clamp(min=1e-300) if bug == "accept with q/p" else p_d / q_d
        accept = uniforms < ratio.clamp(max=1)
        n = accept.long().cumprod(1).sum(1)
        p_n = target[rows, n]
        residual = (p_n - q[rows, n.clamp(max=K - 1)]).clamp(min=0)
        if bug != "no residual normalisation":
            residual = residual / residual.sum(1, keepdim=True).clamp(min=1e-300)
        if bug == "resample from p":
            residual = p_n
        final_dist = torch.where((n < K)[:, None], residual, p_n)
        u = 1 - torch.exp(-noise[rows, n, 0])  # a uniform from the noise
        final = torch.searchsorted(final_dist.cumsum(1), u[:, None])[:, 0].clamp(max=V - 1)
        out = torch.full((B, K + 1), PLACEHOLDER)
        out[:, :K] = torch.where(torch.arange(K)[None] < n[:, None], drafts, PLACEHOLDER)
        emit = n < K if bug == "no bonus token" else torch.ones(B, dtype=torch.bool)
        out[rows[emit], n[emit]] = final[emit]
        return out
    return sample


# each bug with a pair where it shows: the residual matters where q puts mass p lacks; the bonus where
# drafts are often all accepted; the acceptance ratio where p and q differ
BUGS = {"no residual normalisation": "q uniform", "no bonus token": "q = p", "resample from p": "random pair 1",
        "accept with q/p": "random pair 2"}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_keeps_the_target_distribution(case):
    p, q = CASES[case]
    got = pvalues(rejection_sample, p, q)
    assert min(got.values()) > ALPHA, got
    assert len(got) >= 2  # the length and at least the first token were tested


@pytest.mark.parametrize("case", CASES)
def test_the_inverse_cdf_rewrite_without_a_bug_passes_too(case):
    """So the planted samplers fail because of their bug, not because they are written differently."""
    p, q = CASES[case]
    got = pvalues(planted(None), p, q)
    assert min(got.values()) > ALPHA, got


@pytest.mark.parametrize("bug", BUGS)
def test_a_planted_wrong_sampler_fails(bug):
    got = pvalues(planted(bug), *CASES[BUGS[bug]])
    assert min(got.values()) < ALPHA * 1e-3, got


# ---- greedy ---------------------------------------------------------------------------------------------------

def test_greedy_accepts_while_the_draft_is_the_argmax():
    argmax = torch.tensor([[5, 6, 9, 3], [5, 6, 7, 3], [1, 2, 3, 4], [4, 4, 4, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [4, 4, -1]])
    out = greedy_verify(argmax, drafts, torch.tensor([3, 3, 3, 2]))
    assert out.tolist() == [[5, 6, 9, -1],  # third draft wrong: the target's 9 replaces it
                            [5, 6, 7, 3],  # all accepted: the bonus token 3
                            [1, -1, -1, -1],  # the first wrong: the target's token only, later matches ignored
                            [4, 4, 4, -1]]  # two drafts, both accepted: the bonus from row 2


# ---- the engine's wrapper: logits, temperature / top-k / top-p, seeds -----------------------------------------

def _requests(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams(**params)) for i in range(n)]


def test_the_wrapper_applies_temperature_and_top_k_to_p_as_the_sampler_does():
    """One-hot draft token 1 then 0 over logits with top_k=3 at T=0.7: the first emitted token follows the
    processed p_0 (token 4 is outside the top 3, never emitted), as Sampler's draws do."""
    n = 20_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5])
    logits = row.expand(n * 3, 5).clone()
    tokens = RejectionSampler(Sampler(0))(logits, _requests(n, temperature=0.7, top_k=3), [[1, 0]] * n)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[:3] = (row[:3].double() / 0.7).softmax(-1)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=5)
    assert chi2_pvalue(first, expected * n) > ALPHA, (first, expected * n)
    # acceptance of the first draft is p_0(1)
    accepted = sum(len(t) > 1 for t in tokens)
    assert abs(accepted / n - float(expected[1])) < 5 * (0.25 / n) ** 0.5


def test_seeded_verification_repeats_whatever_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4 * 3, 7, generator=g)
    reqs = [Request(f"s{i}", [1, 2], SamplingParams(temperature=1.0, seed=100 + i)) for i in range(4)]
    drafts = [[1, 2], [3, 4], [5, 6], [0, 1]]
    whole = RejectionSampler(Sampler(0))(logits, reqs, drafts)
    alone = [RejectionSampler(Sampler(9))(logits[3 * i:3 * i + 3], [reqs[i]], [drafts[i]])[0] for i in range(4)]
    assert whole == alone


def test_top_k_1_sampling_verifies_as_greedy():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8 * 3, 9, generator=g)
    argmax = logits.argmax(-1).reshape(8, 3)
    drafts = [[int(argmax[i, 0]), int(argmax[i, 1]) if i % 2 else 0] for i in range(8)]
    got = RejectionSampler(Sampler(0))(logits, _requests(8, temperature=0.8, top_k=1), drafts)
    want = RejectionSampler(Sampler(0))(logits, _requests(8, temperature=0.0), drafts)
    assert got == want


def test_nan_logits_give_invalid_token():
    logits = torch.zeros(3, 4)
    logits[1, 2] = float("nan")
    assert RejectionSampler(Sampler(0))(logits, _requests(1), [[0, 0]]) == [[-1]]

"""Official tests of lab 10_speculative_decoding: n-gram drafts verified so the output keeps the target's distribution.

The learner writes six engine pieces as plain functions (the seams in grader/seams.py):
`greedy_verify` and `rejection_sample` with its `residual_probs` (engine_core/worker/rejection_sampler.py,
called by the engine's RejectionSampler), `NgramProposer.propose` (prompt lookup; a contract-only task),
and the scheduler's side, `Scheduler._schedule_drafts` (lookahead slots) and
`Scheduler._commit_verified_tokens` (appends, stops, the rollback of num_computed_tokens), plus two numeric
predictions. Every test that runs the learner's code does it inside `plug(student, LAB)`; set-up is written
directly (tensors, a scheduler with a scripted proposer). Expected values come from float64 oracles and
chi-squared tests written here, from a small model of the proposer's contract (`_spec_propose`), from the
fake model of grader.harness (`reference_output`: what any correct schedule emits), or from the reference
engine run in `functools.cache` helpers outside any plug. Every check is an `expect_*` observation.
"""
import functools

import pytest
import torch
from hypothesis import given, seed
from hypothesis import strategies as st

from grader.harness import (CountTorchCalls, FakeRunner, LLM, ModelRunnerOutput, Request, RequestStatus, SamplingParams,
                            check_invariants, fake_continuation, held_blocks, lab_settings, make_scheduler,
                            reference_output)
from grader.observe import expect_close, expect_equal, expect_prediction
from grader.plug import plug

LAB = "10_speculative_decoding"
PLACEHOLDER = -1  # the engine's padding of an output row (engine_core.worker.rejection_sampler.PLACEHOLDER)
FAKE_VOCAB = 50  # the fake model's tokens 0..49 (grader.harness)

# ---- task 1: the predictions -------------------------------------------------------------------

ALPHA, K_PRED, T_WEIGHTS_MS, PER_ROW_MS = 0.8, 4, 5.0, 0.02


def _tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per verify step] = sum_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@pytest.mark.points(1)
@pytest.mark.task("predictions")
def test_predicted_tokens_per_step(student):
    """alpha = 0.8, k = 4: 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616 tokens per verify step.

    Tolerance 0.5%: exact arithmetic; it rejects the formula without the bonus token (alpha^k: 2.952,
    -12%), k * alpha + 1 (4.2), and 1 / (1 - alpha) (5, the limit of infinitely many drafts)."""
    expect_prediction(student.predicted_tokens_per_step(), _tokens_per_step(ALPHA, K_PRED),
                 "predicted_tokens_per_step(): expected tokens one verify step emits, k = 4 drafts, each accepted "
                 "with probability 0.8 independently", rtol=0.005)


@pytest.mark.points(2)
@pytest.mark.task("predictions")
def test_predicted_breakeven_batch(student):
    """t(rows) = 5 ms + 0.02 ms x rows. Plain: B tokens per 5 + 0.02 B ms. Speculating (k = 4, E = 3.3616
    tokens per request and step): E B tokens per 5 + 0.02 x 5 B ms. Equal rates at
    B* = 5 (E - 1) / (0.02 (k + 1 - E)) = 360.4.

    Tolerance 2%: admits E rounded to 3.36 (0.3%); rejects k rows per request instead of k + 1 (925),
    E without the bonus token (238), and the batch where the speculating step costs twice the weight read."""
    e = _tokens_per_step(ALPHA, K_PRED)
    expect_prediction(student.predicted_breakeven_batch(), T_WEIGHTS_MS * (e - 1) / (PER_ROW_MS * (K_PRED + 1 - e)),
                 "predicted_breakeven_batch(): the batch size where speculation (k = 4, alpha = 0.8) stops paying "
                 "under t(rows) = 5 ms + 0.02 ms x rows", rtol=0.02)


# ---- task 2: greedy verification -------------------------------------------------------------------

def _greedy_oracle(argmax, drafts, num_draft):
    """Row by row: accept drafts while each equals the argmax of its row, then that row's argmax."""
    out = []
    for a, d, n in zip(argmax.tolist(), drafts.tolist(), num_draft.tolist()):
        row = []
        for j in range(n):
            if d[j] != a[j]:
                break
            row.append(d[j])
        row.append(a[len(row)])
        out.append(row + [PLACEHOLDER] * (len(a) - len(row)))
    return out


@pytest.mark.points(2)
@pytest.mark.task("greedy_verify")
def test_greedy_verify_by_hand(student):
    """Four requests, K = 3: all three drafts accepted (the bonus token follows); the second rejected
    (the target's token replaces it, nothing after it counts, even a later match); one draft of three
    slots, the padding equal to the argmax (padding is never a draft); no draft at all (a plain decode)."""
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [5, 6, 7], [-1, -1, -1]])
    num_draft = torch.tensor([3, 3, 1, 0])
    with plug(student, LAB, only=["greedy_verify"]):
        got = student.greedy_verify(argmax, drafts, num_draft)
    expect_equal(got.tolist(), [[5, 6, 7, 8], [5, 6, -1, -1], [5, 6, -1, -1], [5, -1, -1, -1]],
                 "greedy_verify(target_argmax rows [5, 6, 7, 8] x 4, drafts [[5, 6, 7], [5, 9, 7], [5, 6, 7], "
                 "[-1, -1, -1]], num_draft [3, 3, 1, 0]): emitted tokens, PLACEHOLDER -1 after")


@pytest.mark.points(2)
@pytest.mark.task("greedy_verify")
def test_greedy_verify_random_batches(student):
    """200 requests, K = 5, a vocabulary of 3 (drafts often match), ragged draft counts 0..5 with random
    padding: the emitted tokens of each equal the row-by-row loop."""
    g = torch.Generator().manual_seed(10)
    argmax = torch.randint(0, 3, (200, 6), generator=g)
    drafts = torch.where(torch.rand(200, 5, generator=g) < 0.7, argmax[:, :5], torch.randint(0, 3, (200, 5), generator=g))
    num_draft = torch.randint(0, 6, (200,), generator=g)
    with plug(student, LAB, only=["greedy_verify"]):
        got = student.greedy_verify(argmax, drafts, num_draft)
    expect_equal(got.tolist(), _greedy_oracle(argmax, drafts, num_draft),
                 "greedy_verify on 200 random requests (K = 5, tokens 0..2, num_draft 0..5, generator seed 10)")



@pytest.mark.points(1)
@pytest.mark.task("greedy_verify")
def test_greedy_verify_no_python_loop_or_host_sync(student):
    """The whole batch in tensor ops, as the text asks: as many torch calls (grader.harness.CountTorchCalls) for 200
    requests as for 4, and no tensor read back to Python (`.item()`, `.tolist()`, `int(t)`: a host sync, which on a
    GPU waits for every kernel queued before it). Independent of the values: a loop over rows with the right
    tokens still fails."""
    g = torch.Generator().manual_seed(11)
    argmax = torch.randint(0, 3, (200, 6), generator=g)
    drafts = torch.where(torch.rand(200, 5, generator=g) < 0.7, argmax[:, :5], torch.randint(0, 3, (200, 5), generator=g))
    num_draft = torch.randint(0, 6, (200,), generator=g)
    counted = []
    with plug(student, LAB, only=["greedy_verify"]):
        for b in (4, 200):
            with CountTorchCalls() as calls:
                student.greedy_verify(argmax[:b], drafts[:b], num_draft[:b])
            counted.append(calls)
    expect_equal((counted[1].calls - counted[0].calls, counted[1].host_syncs), (0, 0),
                 "greedy_verify on 200 requests (K = 5): (its torch calls minus those on 4 requests, its host syncs): "
                 "more requests must not mean more calls, and nothing is read back to Python")


# ---- task 3: the residual distribution -------------------------------------------------------------

def _residual_oracle(p, q):
    r = (p.double() - q.double()).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, torch.ones_like(mass)), p.double())


@pytest.mark.points(2)
@pytest.mark.task("residual_probs")
def test_residual_by_hand(student):
    """p = [0.5, 0.3, 0.2], q = [0.2, 0.5, 0.3]: max(p - q, 0) = [0.3, 0, 0], normalised [1, 0, 0];
    p = [0.4, 0.4, 0.2], q = [0.1, 0.2, 0.7]: [0.3, 0.2, 0] / 0.5 = [0.6, 0.4, 0]; q = p: nothing left,
    p itself. Rows of a [3, 1, 3] batch (any leading shape)."""
    p = torch.tensor([[[0.5, 0.3, 0.2]], [[0.4, 0.4, 0.2]], [[0.1, 0.6, 0.3]]], dtype=torch.float64)
    q = torch.tensor([[[0.2, 0.5, 0.3]], [[0.1, 0.2, 0.7]], [[0.1, 0.6, 0.3]]], dtype=torch.float64)
    with plug(student, LAB, only=["residual_probs"]):
        got = student.residual_probs(p, q)
    expect_close(got, [[[1.0, 0.0, 0.0]], [[0.6, 0.4, 0.0]], [[0.1, 0.6, 0.3]]],
                 "residual_probs(p, q) for p rows [0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.1, 0.6, 0.3] and q rows "
                 "[0.2, 0.5, 0.3], [0.1, 0.2, 0.7], [0.1, 0.6, 0.3] (shape [3, 1, 3])", atol=1e-6)


@pytest.mark.points(1)
@pytest.mark.task("residual_probs")
def test_residual_random_rows(student):
    """64 random pairs over 50 tokens in float32: each row of the result is normalize(max(p - q, 0))
    (float64 oracle; fp32 sums of 50 terms are within 1e-6)."""
    g = torch.Generator().manual_seed(11)
    p = torch.rand(64, 50, generator=g).softmax(-1)
    q = (3 * torch.rand(64, 50, generator=g)).softmax(-1)
    with plug(student, LAB, only=["residual_probs"]):
        got = student.residual_probs(p, q)
    expect_close(got, _residual_oracle(p, q), "residual_probs on 64 random (p, q) rows over 50 tokens, fp32",
                 atol=1e-6)


# ---- task 4: speculative sampling ------------------------------------------------------------------

N = 20_000  # verify steps per case: every planted wrong sampler's p-value is below 1e-12 at this size
V, K = 6, 2
P_MIN = 1e-6  # false alarm chance per check for a correct sampler


def _dist(*w):
    t = torch.tensor(w, dtype=torch.float64)
    return t / t.sum()


P_ROWS = [_dist(4, 3, 2, 1, 0.5, 0.5), _dist(1, 1, 6, 1, 0.5, 0.5), _dist(0.2, 2, 2, 3, 1, 1)]
CASES = {  # target rows p_0, p_1, p_2 and draft rows q_1, q_2
    "disjoint supports": ([_dist(1, 2, 3, 0, 0, 0)] * 3, [_dist(0, 0, 0, 1, 1, 2)] * 2),
    "q = p": (P_ROWS, P_ROWS[:2]),
    "q uniform": (P_ROWS, [_dist(*[1] * V)] * 2),
    "q sharper than p": (P_ROWS, [_dist(8, 1, 0.5, 0.2, 0.2, 0.1), _dist(0.1, 0.1, 9, 0.1, 0.1, 0.1)]),
}


def _chi2_pvalue(observed, expected):
    """P(chi2 >= the statistic), df = categories expected > 0 minus 1, in float64; an outcome that
    cannot happen but did: 0."""
    observed, expected = observed.double(), expected.double()
    if bool(((expected == 0) & (observed > 0)).any()):
        return 0.0
    keep = expected > 0
    df = int(keep.sum()) - 1
    if df < 1:
        return 1.0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _draws(p, q, seed):
    """N verify steps of K drafts drawn from q (None: the fixed drafts ONE_HOT), uniforms and Exp(1) noise."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack(p).expand(N, K + 1, V).clone()
    if q is None:
        drafts, draft_probs = torch.tensor(ONE_HOT).expand(N, K).clone(), None
    else:
        drafts = torch.stack([torch.multinomial(qj, N, replacement=True, generator=g) for qj in q], dim=1)
        draft_probs = torch.stack(q).expand(N, K, V).clone()
    uniforms = torch.rand(N, K, generator=g, dtype=torch.float64)
    noise = torch.empty(N, K + 1, V, dtype=torch.float64).exponential_(generator=g)
    return target, drafts, draft_probs, uniforms, noise


ONE_HOT = (0, 2)  # an n-gram's fixed drafts: likely tokens under p_0 and p_1


def _checks(out, p, q):
    """Exactness, as four chi-squared tests: the number of tokens emitted is 1, 2, 3 with probabilities
    1 - a_1, a_1 (1 - a_2), a_1 a_2 (a_j = sum min(p_j, q_j)); the token at position j, where one was
    emitted, is distributed as p_j. p-values by check."""
    length = (out != PLACEHOLDER).sum(dim=1)
    qs = [torch.nn.functional.one_hot(torch.tensor(d), V).double() for d in ONE_HOT] if q is None else q
    a = [float(torch.minimum(p[j], qs[j]).sum()) for j in range(K)]
    expected_len = torch.tensor([1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]], dtype=torch.float64) * N
    result = {"tokens emitted": _chi2_pvalue(torch.bincount((length - 1).clamp(0, K), minlength=K + 1)[:K + 1],
                                             expected_len)}
    for j in range(K + 1):
        if float(expected_len[j:].sum()) >= 1000:
            tokens = out[length > j, j].clamp(0, V - 1)
            result[f"token {j}"] = _chi2_pvalue(torch.bincount(tokens, minlength=V), p[j] * len(tokens))
    return result


def _sample(student, p, q, seed=0):
    target, drafts, draft_probs, uniforms, noise = _draws(p, q, seed)
    with plug(student, LAB, only=["rejection_sample", "greedy_verify", "residual_probs"]):
        return student.rejection_sample(target, drafts, torch.full((N,), K), uniforms, noise, draft_probs)


def _expect_exact(student, case, p, q):
    pvalues = _checks(_sample(student, p, q), p, q)
    expect_equal({check: pv > P_MIN for check, pv in pvalues.items()}, {check: True for check in pvalues},
                 f"rejection_sample, case {case!r}: p rows {[r.tolist() for r in p]}, q rows "
                 f"{'one-hot on ' + str(ONE_HOT) if q is None else [r.tolist() for r in q]}, {N} verify steps of K = {K}: "
                 f"chi-squared p-value > {P_MIN} for each check (yours: "
                 f"{ {c: f'{pv:.2g}' for c, pv in pvalues.items()} })")


@pytest.mark.points(1)
@pytest.mark.task("rejection_sample")
def test_rejection_sample_no_python_loop_over_requests(student):
    """The batch verified with tensor ops: as many torch calls (grader.harness.CountTorchCalls) for 256
    requests as for 4, with draft probabilities and with one-hot drafts, and no host sync. A loop over the
    requests gives the same tokens and one kernel launch per request and op on a GPU, every step; a host sync
    stalls the GPU until its queue drains."""
    p, q = CASES["q uniform"]
    target, drafts, draft_probs, uniforms, noise = _draws(p, q, seed=5)
    counts, syncs = [], []
    with plug(student, LAB, only=["rejection_sample", "greedy_verify", "residual_probs"]):
        for probs in (draft_probs, None):  # a draft model's q, then one-hot n-gram drafts
            for b in (4, 256):
                with CountTorchCalls() as calls:
                    student.rejection_sample(target[:b], drafts[:b], torch.full((b,), K), uniforms[:b], noise[:b],
                                             None if probs is None else probs[:b])
                counts.append(calls.calls)
                syncs.append(calls.host_syncs)
    expect_equal([counts[1] - counts[0], counts[3] - counts[2], syncs[1], syncs[3]], [0, 0, 0, 0],
                 "rejection_sample on 256 requests against 4 (K = 2, V = 6): [torch calls 256 minus 4 with draft "
                 "probabilities, the same with one-hot drafts, host syncs (.item, .tolist, int(t)) with draft "
                 "probabilities, with one-hot drafts]: more requests must not mean more calls, nothing read back")


@pytest.mark.points(3)
@pytest.mark.task("rejection_sample")
def test_rejection_sample_keeps_the_target_distribution(student):
    """Drafts drawn from q, for q = p, q uniform, q sharper than p: the number of tokens emitted and each
    emitted token's distribution are the target's (chi-squared against float64 expectations)."""
    for case in ("q = p", "q uniform", "q sharper than p"):
        _expect_exact(student, case, *CASES[case])


@pytest.mark.points(2)
@pytest.mark.task("rejection_sample")
def test_rejection_sample_disjoint_supports(student):
    """q puts all its mass where p has none: every draft is rejected (p(d) = 0) and the token emitted is
    a sample of the residual, here p itself."""
    _expect_exact(student, "disjoint supports", *CASES["disjoint supports"])


@pytest.mark.points(2)
@pytest.mark.task("rejection_sample")
def test_rejection_sample_one_hot_drafts(student):
    """draft_probs None (an n-gram draft, q one-hot): each draft is compared with the row's own sample
    argmax(p / noise), the exponential race, so the output is exactly greedy verification of those
    samples; and its distribution is the target's."""
    p = P_ROWS
    target, drafts, _, uniforms, noise = _draws(p, None, seed=3)
    with plug(student, LAB, only=["rejection_sample", "greedy_verify", "residual_probs"]):
        got = student.rejection_sample(target[:64], drafts[:64], torch.full((64,), K), None, noise[:64], None)
    expect_equal(got.tolist(), _greedy_oracle((target[:64] / noise[:64]).argmax(dim=2), drafts[:64], torch.full((64,), K)),
                 "rejection_sample with draft_probs None, 64 steps, drafts (0, 2): the output, against greedy "
                 "verification of each row's sample argmax(p / noise)")
    _expect_exact(student, "one-hot q (n-gram)", p, None)


@pytest.mark.points(1)
@pytest.mark.task("rejection_sample")
def test_rejection_sample_ragged_drafts(student):
    """Requests with 0, 1 and 2 drafts in one batch (padding -1): a request without drafts emits one sample
    of p_0 (its row's race winner, exactly); one with a single draft never emits a third token."""
    p, q = CASES["q uniform"]
    target, drafts, draft_probs, uniforms, noise = _draws(p, q, seed=4)
    num_draft = torch.arange(N) % 3
    drafts = torch.where(torch.arange(K)[None, :] < num_draft[:, None], drafts, PLACEHOLDER)
    with plug(student, LAB, only=["rejection_sample", "greedy_verify", "residual_probs"]):
        out = student.rejection_sample(target, drafts, num_draft, uniforms, noise, draft_probs)
    none = num_draft == 0
    expect_equal(out[none].tolist(), [[t, PLACEHOLDER, PLACEHOLDER] for t in (target[none, 0] / noise[none, 0]).argmax(1).tolist()],
                 "rejection_sample, requests with num_draft 0 (every third of the batch): one token, the winner of "
                 "argmax(p_0 / noise_0), then PLACEHOLDER")
    expect_equal(int((out[num_draft == 1, 2] != PLACEHOLDER).sum()), 0,
                 "rejection_sample, requests with num_draft 1: how many emitted a third token")


# ---- task 5: the n-gram proposer (contract only) ---------------------------------------------------

def _spec_propose(tokens, min_n, max_n, k, max_tokens=None):
    """The contract: the longest n in [min_n, max_n] whose suffix occurred earlier (starting before the
    suffix itself), its first occurrence, the up to min(k, max_tokens) tokens after it."""
    k = k if max_tokens is None else min(k, max_tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens) or k <= 0:
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            return tokens[starts[0] + n:starts[0] + n + k]
    return []


class _Proposer:
    """An NgramProposer's state, set directly (the seam is the method)."""

    def __init__(self, min_n, max_n, k):
        self.min_n, self.max_n, self.k = min_n, max_n, k


PROPOSE_CASES = [  # (tokens, min_n, max_n, k, max_tokens): what each shows
    ([1, 2, 3, 4, 5], 1, 3, 3, None),  # no earlier occurrence: no draft
    ([7, 8, 9, 1, 2, 9, 4, 4, 2, 9], 1, 3, 3, None),  # [4, 2, 9] and [2, 9]... the longest suffix that recurs: [2, 9]
    ([5, 1, 2, 3, 6, 1, 2, 8, 1, 2, 3, 0, 1, 2, 3], 2, 3, 2, None),  # [1, 2, 3] twice: the first wins
    ([1, 2, 9, 9, 3, 1, 2], 1, 2, 4, None),  # the match near the end: fewer than k tokens follow
    ([4, 5, 6, 4, 5, 6, 4, 5], 1, 2, 5, 2),  # max_tokens caps the draft
    ([4, 5, 6, 4, 5, 6, 4, 5], 1, 2, 5, 0),  # max_tokens 0: nothing
    ([7, 7, 7, 7], 1, 2, 3, None),  # overlapping: [7, 7] first at 0, the suffix itself never counts
    ([3, 1, 4, 1, 5, 9, 2, 6, 5], 2, 4, 3, None),  # only a 1-gram [5] recurs, below min_n 2: no draft
    ([3, 1, 4, 1, 5, 9, 2, 6, 5], 1, 4, 3, None),  # with min_n 1 it drafts [9, 2, 6]
    ([6], 1, 3, 3, None),  # a single token: nothing earlier
    ([2, 2], 1, 3, 3, None),  # [2] at 0, then [2]
]


@pytest.mark.points(3)
@pytest.mark.task("propose")
def test_propose_crafted_streams(student):
    """Token streams crafted for each rule of the contract (see PROPOSE_CASES' comments)."""
    with plug(student, LAB, only=["propose"]):
        got = [student.propose(_Proposer(lo, hi, k), list(t), m) for t, lo, hi, k, m in PROPOSE_CASES]
    expect_equal(got, [_spec_propose(*case) for case in PROPOSE_CASES],
                 f"propose(self with (min_n, max_n, k), tokens, max_tokens) for (tokens, min_n, max_n, k, max_tokens) "
                 f"in {PROPOSE_CASES}")


@pytest.mark.points(2)
@pytest.mark.task("propose")
@lab_settings(150)
@seed(20261202)
@given(tokens=st.lists(st.integers(0, 3), max_size=16), min_n=st.integers(1, 3), extra=st.integers(0, 2),
       k=st.integers(1, 5), max_tokens=st.one_of(st.none(), st.integers(0, 6)))
def test_propose_random_streams(student, tokens, min_n, extra, k, max_tokens):
    """Any stream of a 4-token vocabulary (many repeats), any lookup sizes: the contract's draft."""
    with plug(student, LAB, only=["propose"]):
        got = student.propose(_Proposer(min_n, min_n + extra, k), list(tokens), max_tokens)
    expect_equal(list(got), _spec_propose(tokens, min_n, min_n + extra, k, max_tokens),
                 f"propose with min_n {min_n}, max_n {min_n + extra}, k {k} on {tokens}, max_tokens {max_tokens}")


# ---- task 6: the scheduler: lookahead slots and the rollback -------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SCHEDULER_SEAMS = ["_schedule_drafts", "_commit_verified_tokens"]


class ScriptedProposer:
    """Drafts for the fake model: up to min(k, max_tokens) tokens, of which the first `good` are its true
    greedy continuation and the rest wrong (+1 mod 50); `good` = (len(tokens) + last token) mod (k + 1), a
    function of the request's tokens only, so any correct scheduler gets the same drafts."""

    def __init__(self, k):
        self.k = k

    def propose(self, token_ids, max_tokens=None):
        n = self.k if max_tokens is None else min(self.k, max_tokens)
        good = (len(token_ids) + token_ids[-1]) % (self.k + 1)
        return [t if j < good else (t + 1) % FAKE_VOCAB for j, t in enumerate(fake_continuation(token_ids, n))]


class FixedProposer:
    """Always the same drafts (cut to max_tokens)."""

    def __init__(self, drafts):
        self.drafts = list(drafts)

    def propose(self, token_ids, max_tokens=None):
        return self.drafts[:max_tokens]


class PerfectProposer:
    """Drafts the fake model always accepts: its true greedy continuation."""

    def __init__(self, k):
        self.k = k

    def propose(self, token_ids, max_tokens=None):
        return fake_continuation(token_ids, self.k if max_tokens is None else min(self.k, max_tokens))


def _spec_scheduler(num_gpu_blocks=64, k=3, **config):
    sched = make_scheduler(num_gpu_blocks, speculative_config={**SPEC, "num_speculative_tokens": k}, **config)
    sched.proposer = ScriptedProposer(k)
    return sched


def _commit_as_specified(self, request, chunk, tokens, now):
    """Task 6b's contract, for the tests of task 6a (the notebook's `_commit_verified_tokens` comes after
    it): append until a stop, num_computed_tokens over the chunk and the accepted drafts, cache those."""
    status, num_appended = None, 0
    for token in tokens:
        request.append_token(token, now)
        num_appended += 1
        status = request.check_stop(self.max_model_len)
        if status is not None:
            break
    request.num_computed_tokens = chunk.start + chunk.num_tokens + num_appended - 1
    self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
    return status


def _plug_drafts(student):
    """The learner's `_schedule_drafts` with task 6b's contract in place of their `_commit_verified_tokens`."""
    return plug(student, LAB, only=SCHEDULER_SEAMS, overrides={"_commit_verified_tokens": _commit_as_specified})


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.points(2)
@pytest.mark.task("schedule_drafts")
def test_lookahead_slots_by_hand(student):
    """One request, prompt [1, 2, 3, 1, 2, 3, 1] (7 tokens, blocks of 4), k = 3. The prompt step emits its
    first token; the next step is a decode with 3 drafts: 1 + 3 rows, and the block table grows to cover
    positions 0..10 (3 blocks): the third block is the lookahead's, handed over with the chunk."""
    sched = _spec_scheduler()
    request = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=20, temperature=0.0))
    sched.add_request(request)
    kvm = sched.kv_cache_manager
    with _plug_drafts(student):
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput({"a": [2]}))
        out = sched.schedule()
    drafts = sched.proposer.propose(request.all_token_ids, 3)
    expect_equal((out.scheduled_spec_decode_tokens, out.total_num_scheduled_tokens, len(kvm.req_to_blocks["a"]),
                  out.scheduled[0].new_block_ids),
                 ({"a": drafts}, 4, 3, kvm.get_block_ids("a")[2:]),
                 "prompt [1, 2, 3, 1, 2, 3, 1], first token 2 emitted, k = 3, blocks of 4: the decode step's "
                 "(drafts, tokens scheduled, blocks in the table, new_block_ids handed over)")


@pytest.mark.points(2)
@pytest.mark.task("schedule_drafts")
def test_drafts_fit_budget_max_tokens_and_max_model_len(student):
    """Drafts never exceed what is left: of the token budget after the step's real work (budget 6, three
    decodes: 3 rows of drafts in all, the first request's first), of max_tokens (one output token left:
    no draft), of max_model_len (a request 2 tokens from it gets at most 1 draft)."""
    kinds = []
    with _plug_drafts(student):
        sched = _spec_scheduler(max_num_batched_tokens=6)
        for rid in "abc":
            sched.add_request(Request(rid, [4, 5, 4], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
        for _ in range(2):  # a and b prefill, then c prefills next to two decodes
            out = sched.schedule()
            sched.update_from_output(out, ModelRunnerOutput({c.request.request_id: [7] for c in out.scheduled if c.emits}))
        out = sched.schedule()
        kinds.append(("budget 6", {rid: len(d) for rid, d in out.scheduled_spec_decode_tokens.items()},
                      out.total_num_scheduled_tokens))
        sched = _spec_scheduler()
        sched.add_request(Request("m", [4, 5, 4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput({"m": [7]}))
        out = sched.schedule()
        kinds.append(("max_tokens 2, 1 emitted", out.scheduled_spec_decode_tokens, out.total_num_scheduled_tokens))
        sched = _spec_scheduler(max_model_len=6)
        sched.add_request(Request("l", [4, 5, 4], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput({"l": [7]}))
        out = sched.schedule()
        kinds.append(("max_model_len 6, 4 tokens", {r: len(d) for r, d in out.scheduled_spec_decode_tokens.items()},
                      out.total_num_scheduled_tokens))
    expect_equal(kinds, [("budget 6", {"a": 3}, 6), ("max_tokens 2, 1 emitted", {}, 1),
                         ("max_model_len 6, 4 tokens", {"l": 1}, 2)],
                 "k = 3, prompts [4, 5, 4]: (case, draft tokens per request, tokens scheduled in the step)")


@pytest.mark.points(1)
@pytest.mark.task("schedule_drafts")
def test_no_free_block_means_a_plain_decode(student):
    """3 blocks of 4, two requests of 4 tokens after their first output: the first decode's lookahead
    takes the one free block, the second decodes plainly (no preemption for a draft)."""
    with _plug_drafts(student):
        sched = _spec_scheduler(num_gpu_blocks=3)
        for rid in "cd":
            sched.add_request(Request(rid, [1, 2, 1], SamplingParams(max_tokens=5, temperature=0.0)))
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput({"c": [2], "d": [2]}))
        out = sched.schedule()
    expect_equal(({r: len(d) for r, d in out.scheduled_spec_decode_tokens.items()},
                  [c.request.request_id for c in out.scheduled], sched.kv_cache_manager.block_pool.num_free_blocks,
                  out.preempted_request_ids),
                 ({"c": 3}, ["c", "d"], 0, []),
                 "3 blocks of 4, requests c and d of 4 tokens (max_tokens 5), k = 3: (drafts per request, scheduled "
                 "requests, free blocks after the step's allocation, preempted)")


@pytest.mark.points(2)
@pytest.mark.task("commit_verified_tokens")
def test_rollback_by_hand(student):
    """The decode of token 2 carried drafts [3, 1, 2] in positions 8, 9, 10; the target accepted 3 and
    emitted 9 instead of 1. Tokens [3, 9] are appended, num_computed_tokens covers positions 0..8 (9, not
    11: the slots of 1 and 2 are rejected), and the next step recomputes position 9 (token 9)."""
    sched = make_scheduler(64, speculative_config=SPEC)
    sched.proposer = FixedProposer([3, 1, 2])
    request = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=20, temperature=0.0))
    sched.add_request(request)
    with plug(student, LAB, only=SCHEDULER_SEAMS):
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput({"a": [2]}))
        out = sched.schedule()
        drafts = dict(out.scheduled_spec_decode_tokens)
        sched.update_from_output(out, ModelRunnerOutput({"a": [3, 9]}))
        state = (list(request.output_token_ids), request.num_computed_tokens)
        out = sched.schedule()
    expect_equal((drafts, state, (out.scheduled[0].start, out.scheduled[0].token_ids)),
                 ({"a": [3, 1, 2]}, ([2, 3, 9], 9), (9, [9])),
                 "prompt [1, 2, 3, 1, 2, 3, 1], first token 2, drafts [3, 1, 2] (k = 3); the target "
                 "accepts draft 3 and emits 9: (drafts, (output tokens, num_computed_tokens), the next step's "
                 "(start, token_ids))")


@pytest.mark.points(2)
@pytest.mark.task("commit_verified_tokens")
def test_stop_inside_an_accepted_run(student):
    """Perfect drafts (all accepted): EOS as the 3rd output token ends the request there, the rest of the
    run dropped; max_tokens 5 ends after exactly 5 tokens; in both, every block is freed."""
    results = []
    with plug(student, LAB, only=SCHEDULER_SEAMS):
        for max_tokens, eos in ((12, "third"), (5, None)):
            sched = make_scheduler(64, speculative_config=SPEC)
            sched.proposer = PerfectProposer(3)
            prompt = [11, 12, 13, 14, 15]
            stop = reference_output(prompt, 3)[2] if eos else None
            request = Request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), eos_token_id=stop)
            sched.add_request(request)
            runner = FakeRunner.for_scheduler(sched)
            for _ in range(20):
                if not sched.has_unfinished_requests():
                    break
                out = sched.schedule()
                sched.update_from_output(out, runner.execute(out))
            results.append((list(request.output_token_ids), request.status, held_blocks(sched.kv_cache_manager)))
    prompt = [11, 12, 13, 14, 15]
    expect_equal(results, [(reference_output(prompt, 12, eos=reference_output(prompt, 3)[2]),
                            RequestStatus.FINISHED_STOPPED, []),
                           (reference_output(prompt, 5), RequestStatus.FINISHED_LENGTH_CAPPED, [])],
                 "prompt [11..15], the fake model, drafts always its true continuation (k = 3): (output tokens, "
                 "status, blocks still held) with EOS = the 3rd output token (max_tokens 12), then max_tokens 5")


WORKLOAD = [("w0", [1, 2, 3, 4, 5, 6], 17), ("w1", [9, 8, 7], 11), ("w2", [1, 2, 3, 4, 5, 6, 7, 8, 9], 14),
            ("w3", [20, 21], 9), ("w4", [1, 2, 3, 4, 5, 6], 13)]


def _run_workload(**config):
    """WORKLOAD through a speculating scheduler (scripted drafts, varied acceptance) and the fake runner,
    recording per step: the drafts, and the block-table and cache facts the test checks."""
    sched = _spec_scheduler(**config)
    runner = FakeRunner.for_scheduler(sched)
    for rid, prompt, n in WORKLOAD:
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    kvm, bs = sched.kv_cache_manager, sched.block_size
    trace, outputs, problems = [], {}, []
    for k in range(300):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            req = sched.requests[rid]
            need = _cdiv(req.num_computed_tokens + 1 + len(drafts), bs)
            if len(kvm.req_to_blocks[rid]) != need:
                problems.append(f"step {k}: {rid} holds {len(kvm.req_to_blocks[rid])} blocks for "
                                f"{req.num_computed_tokens} computed + 1 + {len(drafts)} drafts ({need} needed)")
        trace.append({rid: len(d) for rid, d in sorted(out.scheduled_spec_decode_tokens.items())})
        for req in sched.update_from_output(out, runner.execute(out)):
            outputs[req.request_id] = list(req.output_token_ids)
        try:
            check_invariants(sched)
        except AssertionError as exc:
            problems.append(f"step {k}: invariant broken: {exc}")
        for req in sched.running:
            rid = req.request_id
            if req.num_output_tokens and req.num_computed_tokens != req.num_tokens - 1:
                problems.append(f"step {k}: {rid} num_computed_tokens {req.num_computed_tokens}, "
                                f"num_tokens {req.num_tokens} (a decode must have exactly its last token left)")
            for j, block in enumerate(kvm.req_to_blocks[rid]):
                if block.block_hash is not None and ((j + 1) * bs > req.num_computed_tokens or block.block_hash.token_ids
                                                     != tuple(req.all_token_ids[j * bs:(j + 1) * bs])):
                    problems.append(f"step {k}: {rid}'s block {j} is in the prefix cache with tokens "
                                    f"{block.block_hash.token_ids}, verified tokens end at {req.num_computed_tokens}")
    stats = sched.stats()
    return (trace, outputs, problems[:3], held_blocks(kvm),
            {key: stats[key] for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens")})


@functools.cache
def _reference_workload():
    return _run_workload(enable_prefix_caching=True, num_gpu_blocks=40, max_num_batched_tokens=16)


@pytest.mark.points(3)
@pytest.mark.task("commit_verified_tokens")
def test_kv_block_accounting_after_rejections(student):
    """Five requests (three sharing a prefix), prefix caching, 40 blocks of 4, budget 16, drafts accepted
    0 to 3 at a time: every step the decode's table covers exactly computed + 1 + drafts, after it
    num_computed_tokens = num_tokens - 1, the scheduler's invariants hold, no prefix-cache block holds an
    unverified token; the outputs are the fake model's, every block is freed, the drafts are the
    reference scheduler's."""
    with plug(student, LAB, only=SCHEDULER_SEAMS):
        trace, outputs, problems, held, stats = _run_workload(enable_prefix_caching=True, num_gpu_blocks=40,
                                                              max_num_batched_tokens=16)
    setup = f"workload {WORKLOAD} (id, prompt, max_tokens), prefix caching, 40 blocks of 4, budget 16, k = 3"
    expect_equal(problems, [], f"{setup}: the first problems seen")
    expect_equal(outputs, {rid: reference_output(p, n) for rid, p, n in WORKLOAD}, f"{setup}: each request's tokens")
    expect_equal(held, [], f"{setup}: (pool, block, ref_cnt) still held after every request finished")
    expect_equal((stats, trace), (_reference_workload()[4], _reference_workload()[0]),
                 f"{setup}: (the spec_decode counters, the drafts per request in each step), against the reference "
                 "scheduler's")


@pytest.mark.points(2)
@pytest.mark.task("commit_verified_tokens")
def test_preemption_with_drafts_in_flight(student):
    """10 blocks of 4 for three requests that need 6 each: decodes with lookahead slots run out of blocks,
    requests are preempted (recompute, and swap to 16 CPU blocks): the tokens are still the fake model's
    and no block is left held."""
    got = []
    with plug(student, LAB, only=SCHEDULER_SEAMS):
        for mode, cpu in (("recompute", 0), ("swap", 16)):
            sched = _spec_scheduler(num_gpu_blocks=10, num_cpu_blocks=cpu, preemption_mode=mode)
            runner = FakeRunner.for_scheduler(sched)
            for rid, prompt, n in WORKLOAD[:3]:
                sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
            outputs = {}
            for _ in range(400):
                if not sched.has_unfinished_requests():
                    break
                out = sched.schedule()
                for req in sched.update_from_output(out, runner.execute(out)):
                    outputs[req.request_id] = list(req.output_token_ids)
            got.append((mode, outputs, held_blocks(sched.kv_cache_manager),
                        sched.stats()[f"num_preemptions_{mode}"] > 0))
    expect_equal(got, [(mode, {rid: reference_output(p, n) for rid, p, n in WORKLOAD[:3]}, [], True)
                       for mode in ("recompute", "swap")],
                 f"requests {WORKLOAD[:3]} in 10 GPU blocks of 4, k = 3: (preemption mode, tokens, blocks held after, "
                 "preempted at least once)")


# ---- end to end: tiny-llama with n-gram speculation ------------------------------------------------------

E2E_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
E2E_PROMPTS = [list(range(10, 20)) * 3, [5, 6, 7, 8] * 5, [(37 * i) % 500 + 3 for i in range(20)],
               list(range(10, 20)) * 2 + [77, 78]]
E2E_ARGS = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=True,
                num_gpu_blocks=128)
ENGINE_SEAMS = ["greedy_verify", "rejection_sample", "propose", "_schedule_drafts", "_commit_verified_tokens"]


def _e2e_params():
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 18, 14, 20)]
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7 + i, ignore_eos=True) for i in range(4)]
    return greedy + seeded


def _run_e2e(spec):
    """Greedy then seeded requests on the repetitive prompts: tokens, the spec counters, the pool whole."""
    llm = LLM("tiny-llama", device="cpu", speculative_config=spec, **E2E_ARGS)
    outs = llm.generate(E2E_PROMPTS * 2, _e2e_params(), use_tqdm=False)
    stats = llm.engine.stats()
    kvm = llm.engine.scheduler.kv_cache_manager
    counters = {k: stats.get(k) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                          "spec_decode_num_accepted_tokens")}
    return [o.outputs[0].token_ids for o in outs], counters, kvm.block_pool.num_free_blocks == kvm.num_gpu_blocks


@functools.cache
def _reference_e2e():
    """The reference engine without speculation (the tokens) and with it (its counters), outside any plug."""
    plain, _, _ = _run_e2e(None)
    _, counters, _ = _run_e2e(E2E_SPEC)
    assert counters["spec_decode_num_accepted_tokens"] > 0, "the prompts must make drafts hit (a test bug)"
    return plain, counters


@pytest.mark.points(4)
@pytest.mark.task("end_to_end")
@pytest.mark.end_to_end
def test_engine_with_speculation_equals_the_engine_without(student):
    """tiny-llama with your proposer, verifiers and scheduler pieces, n-gram drafts (k = 3, lookups 1..3)
    on prompts that repeat themselves, prefix caching, a 32-token budget: greedy requests emit token for
    token what the engine emits without speculation, and so do seeded sampled requests (temperature 0.8,
    top-k 20: n-gram drafts are verified against each row's own seeded sample); as many drafts and
    accepted tokens as the reference engine with speculation; every block free at the end."""
    with plug(student, LAB, only=ENGINE_SEAMS) as plugged:
        tokens, counters, whole = _run_e2e(E2E_SPEC)
    setup = (f"tiny-llama, {E2E_SPEC}, prompts of lengths {[len(p) for p in E2E_PROMPTS]}, greedy then seeded "
             f"(temperature 0.8, top_k 20)")
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the engine never called")
    expect_equal(tokens[:4], _reference_e2e()[0][:4], f"{setup}: the greedy requests' tokens (the engine without speculation)")
    expect_equal(tokens[4:], _reference_e2e()[0][4:], f"{setup}: the seeded requests' tokens (the engine without speculation)")
    expect_equal((counters, whole), (_reference_e2e()[1], True),
                 f"{setup}: (drafts, draft tokens, accepted tokens; every GPU block free after the run), against the "
                 "reference engine with speculation")

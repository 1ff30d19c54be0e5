"""Verifying draft tokens against the target model so the output keeps the target's distribution exactly
(Leviathan et al. 2023, Chen et al. 2023; vLLM's `vllm/v1/sample/rejection_sampler.py`).

A speculating request brings k draft tokens d_1..d_k and gets k + 1 rows of target logits: row j is the
target's distribution p_j for the token after the request's tokens and d_1..d_j.
- greedy: accept d_{j+1} while it is argmax p_j; then emit argmax p_j at the first mismatch, or argmax p_k
  (the bonus token) when all k are accepted. Token for token what plain greedy decoding emits.
- random: accept d_{j+1} with probability min(1, p_j(d) / q_j(d)); at the first rejection emit a sample of
  normalize(max(p_j - q_j, 0)); when all k are accepted, a bonus sample of p_k. Each emitted token then has
  the target's distribution given the tokens before it. An n-gram draft is a deterministic guess, q one-hot
  on the draft token: acceptance is p(d), the residual is p with d removed. That is what comparing the
  draft with the target's own sample of the row gives (it is d with probability p(d), and otherwise a
  sample of p without d), so n-gram drafts are verified that way: the emitted tokens are then the ones
  plain sampling draws with the same noise.
p (and q) are the target's (draft's) logits after the request's temperature, top-k and top-p, as the plain
`Sampler` computes them. Randomness per output position m of a seeded request: the generator seeded with
`draw_seed(seed, m)` gives the Exp(1) noise the plain sampler draws at m. So a seeded request emits the
same tokens with n-gram speculation as without, whatever the batch, the drafts or preemptions.
"""
from __future__ import annotations

import torch

from engine_core.request import Request
from engine_core.worker.sampler import INVALID_TOKEN, Sampler, apply_top_k_top_p, draw_seed

PLACEHOLDER = -1  # pads an output row past its emitted tokens
UNIFORM_SALT = 0x2545F4914F6CDD1D  # separates the accept test's seeded draws from the sampling noise


# seam: lab 10 (grader/seams.py)
def greedy_verify(target_argmax: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """`[B, K+1]` argmax of each row, `[B, K]` drafts (padded), `[B]` draft counts -> `[B, K+1]` emitted
    tokens: the accepted drafts, then the target's token, PLACEHOLDER after."""
    accept = (draft_token_ids == target_argmax[:, :-1]) & _valid(draft_token_ids, num_draft)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    return _emit(draft_token_ids, num_accepted, target_argmax.gather(1, num_accepted[:, None])[:, 0])


# seam: lab 10 (grader/seams.py)
def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                     uniforms: torch.Tensor | None, noise: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The random case. `target_probs` `[B, K+1, V]` (each row a distribution), drafts `[B, K]` drawn from
    `draft_probs` `[B, K, V]` (None: one-hot, an n-gram draft), `uniforms` `[B, K]` in [0, 1) (read only
    with draft_probs), `noise` `[B, K+1, V]` Exp(1) -> `[B, K+1]` emitted tokens, PLACEHOLDER after."""
    if draft_probs is None:  # one-hot q: the draft against the row's own sample (the exponential race)
        return greedy_verify((target_probs / noise).argmax(dim=2), draft_token_ids, num_draft)
    B, K = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    drafts = draft_token_ids.clamp(min=0)
    p_draft = target_probs[:, :K].gather(2, drafts[..., None])[..., 0]
    q_draft = draft_probs.gather(2, drafts[..., None])[..., 0]
    # u < p/q without the division (q > 0 for a token drawn from q); p/q > 1 accepts surely, as min(1, p/q)
    accept = (uniforms * q_draft < p_draft) & _valid(draft_token_ids, num_draft)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    p = target_probs[rows, num_accepted]  # [B, V]: the row that emits the last token
    rejected = num_accepted < num_draft
    if K:
        residual = residual_probs(p, draft_probs[rows, num_accepted.clamp(max=K - 1)])
        p = torch.where(rejected[:, None], residual, p)
    final = (p / noise[rows, num_accepted]).argmax(dim=1)  # the exponential race: a sample of p
    return _emit(draft_token_ids, num_accepted, final)


# seam: lab 10 (grader/seams.py)
def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) row by row (`[..., V]`): what a rejected position samples from. Where the
    residual has no mass (p <= q everywhere, which a rejection rules out up to rounding), p itself."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def _valid(draft_token_ids: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    return torch.arange(draft_token_ids.shape[1], device=draft_token_ids.device)[None, :] < num_draft[:, None]


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    B, K = draft_token_ids.shape
    out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.long, device=draft_token_ids.device)
    cols = torch.arange(K, device=draft_token_ids.device)[None, :]
    out[:, :K] = torch.where(cols < num_accepted[:, None], draft_token_ids, PLACEHOLDER)
    out[torch.arange(B, device=out.device), num_accepted] = final
    return out


class RejectionSampler:
    """The engine's side: logits of the 1 + k rows of each speculating request -> its emitted tokens."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler  # its generators: unseeded draws share the engine's

    def __call__(self, logits: torch.Tensor, requests: list[Request], draft_token_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
        """`logits` `[sum(1 + len(d)), V]` (fp32), each request's rows together, in order -> per request the
        emitted tokens (1 to len(d) + 1), or [INVALID_TOKEN] when a row's logits are NaN or infinite.
        `draft_probs` (a draft model's): per request q `[len(d), V]` its drafts were drawn from (None for a
        greedy request); None for all: one-hot q (n-gram drafts)."""
        B, V = len(requests), logits.shape[1]
        K = max(len(d) for d in draft_token_ids)
        dev = logits.device
        starts = [0]
        for d in draft_token_ids:
            starts.append(starts[-1] + len(d) + 1)
        # [B, K+1, V], rows past a request's 1 + len(d) padded with its last row (never read)
        index = torch.tensor([[s + min(j, len(d)) for j in range(K + 1)] for s, d in zip(starts, draft_token_ids)],
                             device=dev)
        x = logits[index]
        drafts = torch.tensor([d + [PLACEHOLDER] * (K - len(d)) for d in draft_token_ids], dtype=torch.long,
                              device=dev).reshape(B, K)
        num_draft = torch.tensor([len(d) for d in draft_token_ids], device=dev)
        invalid = (~x.amax(dim=2).isfinite()).any(dim=1)
        out = greedy_verify(x.argmax(dim=2), drafts, num_draft)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=dev)
            params = [requests[i].sampling_params for i in sampled]
            temps = torch.tensor([p.temperature for p in params], device=dev)
            xs = (x[rows] / temps[:, None, None]).reshape(len(sampled) * (K + 1), V)
            xs = apply_top_k_top_p(xs, [p.top_k for p in params for _ in range(K + 1)],
                                   [p.top_p for p in params for _ in range(K + 1)])
            probs = xs.softmax(dim=-1).reshape(len(sampled), K + 1, V)
            invalid[rows] |= probs.isnan().any(dim=2).any(dim=1)
            noise = self._noise([requests[i] for i in sampled], K, V).to(dev)
            q, uniforms = None, None
            if draft_probs is not None:  # padded positions: uniform q, never read past num_draft
                q = torch.full((len(sampled), K, V), 1.0 / V, device=dev)
                for r, i in enumerate(sampled):
                    q[r, :len(draft_token_ids[i])] = draft_probs[i].to(dev)
                uniforms = self._uniforms([requests[i] for i in sampled], K).to(dev)
            out[rows] = rejection_sample(probs, drafts[rows], num_draft[rows], uniforms, noise, q)
        result = []
        for i, tokens in enumerate(out.tolist()):
            result.append([INVALID_TOKEN] if bool(invalid[i]) else [t for t in tokens if t != PLACEHOLDER])
        return result

    def _uniforms(self, requests: list[Request], K: int) -> torch.Tensor:
        """U[0, 1) `[B, K]` for the accept test of a draft model's drafts: seeded rows from (seed, position)
        with their own salt (independent of the noise), the rest from the engine's generator."""
        u = torch.empty(len(requests), K)
        g = self.sampler.seeded
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is None:
                u[i].uniform_(generator=self.sampler.generator)
                continue
            for j in range(K):
                g.manual_seed(draw_seed(seed ^ UNIFORM_SALT, r.num_output_tokens + j))
                u[i, j].uniform_(generator=g)
        return u

    def _noise(self, requests: list[Request], K: int, V: int) -> torch.Tensor:
        """Exp(1) noise `[B, K+1, V]`: row j of a seeded request is the plain sampler's draw for its output
        position num_output_tokens + j; unseeded requests draw from the engine's generator."""
        noise = torch.empty(len(requests), K + 1, V)
        g = self.sampler.seeded
        for i, r in enumerate(requests):
            seed = r.sampling_params.seed
            if seed is None:
                noise[i].exponential_(generator=self.sampler.generator)
                continue
            for j in range(K + 1):
                g.manual_seed(draw_seed(seed, r.num_output_tokens + j))
                noise[i, j].exponential_(generator=g)
        return noise

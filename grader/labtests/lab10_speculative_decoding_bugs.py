"""Planted bugs for lab 10_speculative_decoding: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    PlantedBug("prediction_no_bonus_token", "return (1 - alpha ** (k + 1)) / (1 - alpha)",
               "return (1 - alpha ** k) / (1 - alpha)"),
    PlantedBug("prediction_k_rows_per_request", "(per_row * (k + 1 - e))", "(per_row * (k - e))"),
    # greedy_verify
    # every matching draft counted, also after a mismatch (no cumulative product)
    PlantedBug("greedy_accepts_after_a_mismatch", "num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # the run",
               "num_accepted = accept.long().sum(dim=1)  # the run"),
    PlantedBug("greedy_padding_counts_as_drafts", "accept = (draft_token_ids == target_argmax[:, :K]) & (cols < num_draft[:, None])",
               "accept = draft_token_ids == target_argmax[:, :K]"),
    # the bonus token skipped: a fully accepted run emits only the drafts
    PlantedBug("greedy_bonus_token_skipped",
               "    out[rows, num_accepted] = target_argmax[rows, num_accepted]  # the correction, or the bonus token\n",
               "    fix = num_accepted < num_draft\n"
               "    out[rows[fix], num_accepted[fix]] = target_argmax[rows[fix], num_accepted[fix]]\n"),
    # residual_probs
    PlantedBug("residual_not_normalised", "residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)", "residual, p)"),
    PlantedBug("residual_q_minus_p", "    residual = (p - q).clamp(min=0)\n", "    residual = (q - p).clamp(min=0)\n"),
    # q = p gives an all-zero residual: 0 / 0 = NaN rows instead of p
    PlantedBug("residual_no_empty_guard", "torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)",
               "residual / mass"),
    # rejection_sample
    PlantedBug("accept_with_q_over_p", "accept = (uniforms * q_d < p_d) & (cols < num_draft[:, None])",
               "accept = (uniforms * p_d < q_d) & (cols < num_draft[:, None])"),
    # the draft at position j read against the target row j + 1 (off by one row)
    PlantedBug("accept_against_the_next_row", "p_d = target_probs[:, :K].gather(2, drafts[..., None])[..., 0]",
               "p_d = target_probs[:, 1:].gather(2, drafts[..., None])[..., 0]"),
    # after a rejection the target's own row resampled: the residual step skipped
    PlantedBug("resample_from_p_not_the_residual", "        p = torch.where(rejected[:, None], residual, p)  # all",
               "        p = torch.where(rejected[:, None], p, p)  # all"),
    # all accepted: the bonus token drawn from the last draft row q_k instead of p
    PlantedBug("bonus_token_from_q", "        p = torch.where(rejected[:, None], residual, p)  # all",
               "        p = torch.where(rejected[:, None], residual, draft_probs[rows, num_accepted.clamp(max=K - 1)])  # all"),
    # n-gram drafts verified greedily (against the argmax, not the row's own sample): no longer a sample of p
    PlantedBug("one_hot_drafts_verified_greedily", "return greedy_verify((target_probs / noise).argmax(dim=2), draft_token_ids, num_draft)",
               "return greedy_verify(target_probs.argmax(dim=2), draft_token_ids, num_draft)"),
    # greedy_verify row by row in Python, each row read back (a host sync per row): right tokens, slow
    PlantedBug("greedy_loops_over_rows_with_host_syncs",
               "    B, K = draft_token_ids.shape\n    dev = draft_token_ids.device\n    cols = torch.arange(K, device=dev)[None, :]\n",
               "    B, K = draft_token_ids.shape\n    dev = draft_token_ids.device\n"
               "    if B > 1:\n"
               "        out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.long, device=dev)\n"
               "        for i in range(B):\n"
               "            a, d, n = target_argmax[i].tolist(), draft_token_ids[i].tolist(), int(num_draft[i])\n"
               "            j = 0\n"
               "            while j < n and d[j] == a[j]:\n"
               "                j += 1\n"
               "            out[i, :j + 1] = torch.tensor(d[:j] + [a[j]])\n"
               "        return out\n"
               "    cols = torch.arange(K, device=dev)[None, :]\n"),
    # the same sampler, one request at a time (a Python loop over the batch): right tokens, slow
    PlantedBug("rejection_sample_loops_over_requests",
               "    if draft_probs is None:  # one-hot q: each draft against the row's own sample\n",
               "    if draft_probs is not None and target_probs.shape[0] > 1:\n"
               "        return torch.cat([rejection_sample(target_probs[i:i + 1], draft_token_ids[i:i + 1], num_draft[i:i + 1],\n"
               "                                           uniforms[i:i + 1], noise[i:i + 1], draft_probs[i:i + 1])\n"
               "                          for i in range(target_probs.shape[0])])\n"
               "    if draft_probs is None:  # one-hot q: each draft against the row's own sample\n"),
    # propose
    PlantedBug("ngram_matches_the_suffix_itself", "for start in range(n_tokens - n):", "for start in range(n_tokens - n + 1):"),
    PlantedBug("ngram_latest_occurrence_wins", "for start in range(n_tokens - n):", "for start in reversed(range(n_tokens - n)):"),
    PlantedBug("ngram_shortest_suffix_first", "for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):",
               "for n in range(self.min_n, min(self.max_n, n_tokens - 1) + 1):"),
    PlantedBug("ngram_ignores_max_tokens", "k = self.k if max_tokens is None else min(self.k, max_tokens)", "k = self.k"),
    # _schedule_drafts
    PlantedBug("drafts_not_capped_by_max_model_len", "limit = min(budget, self.max_model_len - request.num_tokens - 1,",
               "limit = min(budget, self.max_model_len,"),
    PlantedBug("drafts_not_capped_by_max_tokens",
               "                    request.sampling_params.max_tokens - request.num_output_tokens - 1)",
               "                    request.sampling_params.max_tokens)"),
    # lookahead slots one short: the runner has no slot for the last draft's KV
    PlantedBug("lookahead_slots_one_short", "allocate_slots(request, chunk.num_tokens + len(drafts))",
               "allocate_slots(request, len(drafts))"),
    PlantedBug("lookahead_blocks_not_handed_over", "        chunk.new_block_ids.extend(b.block_id for b in new_blocks)\n", ""),
    # the runner is not told it has the lookahead blocks: the next step sends them again
    PlantedBug("sent_tables_not_updated", "        self._sent_tables[rid] = (table, len(table))\n", ""),
    PlantedBug("drafts_do_not_use_budget", "        budget -= len(drafts)\n", ""),
    # _commit_verified_tokens
    PlantedBug("rollback_off_by_one", "request.num_computed_tokens = chunk.start + chunk.num_tokens + num_appended - 1",
               "request.num_computed_tokens = chunk.start + chunk.num_tokens + num_appended"),
    # only the chunk counted: the accepted drafts' KV, written and verified, is computed again next step
    PlantedBug("rollback_forgets_the_accepted_drafts",
               "request.num_computed_tokens = chunk.start + chunk.num_tokens + num_appended - 1",
               "request.num_computed_tokens = chunk.start + chunk.num_tokens"),
    PlantedBug("appends_past_a_stop", "        if status is not None:\n            break\n",
               "        if status is not None and token == tokens[-1]:\n            break\n"),
    # blocks published over the emitted tokens: the last one's KV is not written yet
    PlantedBug("caches_an_unverified_block", "self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)",
               "self.kv_cache_manager.cache_blocks(request, request.num_tokens)"),
]

"""Planted bugs for lab 04_chunked_prefill: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    PlantedBug("threshold_ignored", "if threshold > 0:", "if threshold < 0:"),
    PlantedBug("unchunked_partial_prompt", "return remaining if remaining <= budget else 0",
               "return min(remaining, budget)"),
    # the threshold applied without chunking too: a prompt over the threshold never runs
    PlantedBug("unchunked_applies_threshold",
               "    if not self.chunked_prefill:\n        return remaining if remaining <= budget else 0\n"
               "    threshold = self.config.long_prefill_token_threshold\n    if threshold > 0:\n"
               "        remaining = min(remaining, threshold)\n",
               "    threshold = self.config.long_prefill_token_threshold\n    if threshold > 0:\n"
               "        remaining = min(remaining, threshold)\n"
               "    if not self.chunked_prefill:\n        return remaining if remaining <= budget else 0\n"),
    PlantedBug("admission_ignores_max_num_seqs", "while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:",
               "while self.waiting and budget > 0:"),
    # the hit set as computed before allocate_slots: hits counted twice (over-allocation), a failed admission
    # leaves the request changed
    PlantedBug("computed_set_before_allocating",
               "        if num_new == 0 or kvm.allocate_slots(request, num_new, hits) is None:\n            break\n"
               "        self.waiting.popleft()\n        request.num_computed_tokens = num_cached\n",
               "        request.num_computed_tokens = num_cached\n"
               "        if num_new == 0 or kvm.allocate_slots(request, num_new, hits) is None:\n            break\n"
               "        self.waiting.popleft()\n"),
    PlantedBug("cache_hit_not_counted_as_computed", "request.num_computed_tokens = num_cached",
               "request.num_computed_tokens = 0"),
    # prefix-cache queries counted per chunk, not per request's tokens: the hit rate looks better than it is
    PlantedBug("queries_count_the_chunk", "self.counters.prefix_cache_queries += request.num_tokens",
               "self.counters.prefix_cache_queries += num_new"),
    PlantedBug("running_budget_not_decremented", "        budget -= num_new\n        i = self.running.index(request) + 1",
               "        i = self.running.index(request) + 1"),
    PlantedBug("victim_chunk_kept", "dropped = chunks.pop(victim.request_id, None)", "dropped = None"),
    # the victim's chunk is dropped but its tokens are not given back: budget left unused after a preemption
    PlantedBug("victim_budget_not_returned", "                budget += dropped.num_tokens\n", ""),
    PlantedBug("swapped_never_resumed", "        budget = self._swap_in(out, budget)\n", ""),
    # swapped-in tokens not taken from the budget: the step runs over it
    PlantedBug("swap_in_budget_not_taken", "        budget = self._swap_in(out, budget)\n",
               "        self._swap_in(out, budget)\n"),
    # a waiting request overtakes a swapped one that does not fit yet
    PlantedBug("admits_while_swapped", "        if not self.swapped:\n            self._admit_waiting(out, budget)",
               "        self._admit_waiting(out, budget)"),
    PlantedBug("admits_while_preempting", "if not out.preempted_request_ids:", "if True:"),
    PlantedBug("waiting_before_running", "    i = 0\n    while i < len(self.running) and budget > 0:",
               "    i = len(self.running)\n    self._admit_waiting(out, budget)\n"
               "    budget -= out.total_num_scheduled_tokens\n    while i < len(self.running) and budget > 0:"),
    # the prediction: both steps priced as compute (FLOPs only), forgetting that a 64-token step reads all weights
    PlantedBug("prediction_compute_only", "    return 1e3 * max(weight_bytes / H100_BYTES_PER_S, flops / H100_FLOPS)",
               "    return 1e3 * flops / H100_FLOPS"),
    # the prediction: both steps priced as a memory-bound decode step
    PlantedBug("prediction_memory_only", "    return 1e3 * max(weight_bytes / H100_BYTES_PER_S, flops / H100_FLOPS)",
               "    return 1e3 * weight_bytes / H100_BYTES_PER_S"),
]

"""Planted bugs for lab 04_chunked_prefill: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    PlantedBug("threshold_ignored", "if threshold > 0:", "if threshold < 0:"),
    PlantedBug("unchunked_partial_prompt", "return remaining if remaining <= budget else 0",
               "return min(remaining, budget)"),
    PlantedBug("admission_ignores_max_num_seqs", "while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:",
               "while self.waiting and budget > 0:"),
    PlantedBug("cache_hit_not_counted_as_computed", "request.num_computed_tokens = num_cached",
               "request.num_computed_tokens = 0"),
    PlantedBug("running_budget_not_decremented", "        budget -= num_new\n        i = self.running.index(request) + 1",
               "        i = self.running.index(request) + 1"),
    PlantedBug("victim_chunk_kept", "dropped = chunks.pop(victim.request_id, None)", "dropped = None"),
    PlantedBug("swapped_never_resumed", "        budget = self._swap_in(out, budget)\n", ""),
    PlantedBug("admits_while_preempting", "if not out.preempted_request_ids:", "if True:"),
    PlantedBug("waiting_before_running", "    i = 0\n    while i < len(self.running) and budget > 0:",
               "    i = len(self.running)\n    self._admit_waiting(out, budget)\n"
               "    budget -= out.total_num_scheduled_tokens\n    while i < len(self.running) and budget > 0:"),
]

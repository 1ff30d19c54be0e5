"""Planted bugs for lab 12_serving: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    # the sojourn time 1 / (mu - lam) (wait + service) taken for the wait in the queue
    PlantedBug("prediction_sojourn_for_wait", "    wq = lam / (mu * (mu - lam))\n", "    wq = 1 / (mu - lam)\n"),
    PlantedBug("prediction_little_with_sojourn", "return lam * (lam / (mu * (mu - lam)))", "return lam * (1 / (mu - lam))"),
    PlantedBug("prediction_replicas_from_throughput_alone", "return math.ceil(10_000 / lo)",
               "return math.ceil(10_000 / mu)"),
    PlantedBug("prediction_replicas_decode_left_out", "mu = 1 / (2000 / 25_000 + 500 / 5_000)", "mu = 1 / (2000 / 25_000)"),
    # append
    PlantedBug("priority_inverted", "key = (request.priority, request.arrival_time)",
               "key = (-request.priority, request.arrival_time)"),
    PlantedBug("ties_broken_by_latest_arrival", "key = (request.priority, request.arrival_time)",
               "key = (request.priority, -request.arrival_time)"),
    PlantedBug("priority_ignored_fcfs", "key = (request.priority, request.arrival_time)",
               "key = (0, request.arrival_time)"),
    # equal keys: the newcomer goes before the requests already waiting with the same key
    PlantedBug("equal_keys_newest_first", "bisect.bisect_right(self._keys, key)", "bisect.bisect_left(self._keys, key)"),
    # the keys list not kept in step: the engine's popleft then deletes from an empty list
    PlantedBug("keys_not_kept_in_step", "    self._keys.insert(pos, key)\n", ""),
    # _select_victim
    PlantedBug("victim_most_important", "return max(self.running, key=lambda r: (r.priority, r.arrival_time))",
               "return min(self.running, key=lambda r: (r.priority, r.arrival_time))"),
    PlantedBug("victim_earliest_arrival_among_ties", "key=lambda r: (r.priority, r.arrival_time))",
               "key=lambda r: (r.priority, -r.arrival_time))"),
    # removes the victim itself: the scheduler's _preempt removes it again
    PlantedBug("victim_removed_from_running", "    return max(self.running, key=lambda r: (r.priority, r.arrival_time))\n",
               "    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))\n"
               "    self.running.remove(victim)\n    return victim\n"),
    PlantedBug("victim_ignores_priority", "key=lambda r: (r.priority, r.arrival_time))", "key=lambda r: r.arrival_time)"),
    # request_metrics
    PlantedBug("itl_includes_ttft", "itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]",
               "itl = [b - a for a, b in zip([send_time, *chunk_times], chunk_times)]"),
    PlantedBug("tpot_over_every_token", "tpot = (e2el - ttft) / (num_output_tokens - 1) if",
               "tpot = (e2el - ttft) / num_output_tokens if"),
    # TPOT as the mean ITL: wrong once a chunk carries several tokens
    PlantedBug("tpot_as_mean_chunk_gap", "tpot = (e2el - ttft) / (num_output_tokens - 1) if num_output_tokens > 1",
               "tpot = sum(itl) / len(itl) if itl"),
    PlantedBug("no_check_for_empty_chunks", "    if not chunk_times:\n        raise ValueError(", "    if False:\n        raise ValueError("),
    # percentile
    PlantedBug("percentile_rank_off_by_one", "rank = q / 100 * (len(xs) - 1)", "rank = min(q / 100 * len(xs), len(xs) - 1)"),
    PlantedBug("percentile_nearest_rank", "    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])\n",
               "    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]\n"),
    PlantedBug("percentile_not_sorted", "xs = sorted(values)", "xs = list(values)"),
    # sorts the caller's list in place (the text forbids changing it)
    PlantedBug("percentile_sorts_in_place", "xs = sorted(values)", "values.sort()\n    xs = values"),
    PlantedBug("percentile_q_unchecked", "    if not 0 <= q <= 100:\n", "    if False:\n"),
    # meets_slos
    PlantedBug("goodput_any_slo", "        if value is not None and value > limit:\n            return False\n    return True\n",
               "        if value is not None and value <= limit:\n            return True\n    return not slos\n"),
    PlantedBug("missing_tpot_held_against", "if value is not None and value > limit:",
               "if value is None or value > limit:"),
    PlantedBug("slo_limit_exclusive", "if value is not None and value > limit:", "if value is not None and value >= limit:"),
    # lookup
    # past the last point the walk stops at the last point instead of wrapping to the first
    PlantedBug("ring_not_wrapping", "url = self._urls[(start + k) % len(self._urls)]",
               "url = self._urls[min(start + k, len(self._urls) - 1)]"),
    PlantedBug("lookup_ignores_allowed", "        if url in allowed:\n            return url\n    return None\n",
               "        return url\n    return None\n"),
    # ">=" where the text says "greater than": a key whose hash equals a point stays on that point
    PlantedBug("lookup_bisect_left", "start = bisect.bisect(self._hashes, _hash(key))",
               "start = bisect.bisect_left(self._hashes, _hash(key))"),
    # the first point found by a scan of every hash: the same answers, O(n) reads per request
    PlantedBug("lookup_linear_scan", "start = bisect.bisect(self._hashes, _hash(key))",
               "start = next((i for i, h in enumerate(self._hashes) if h > _hash(key)), len(self._hashes))"),
    # load_bound and prefix_aware
    PlantedBug("bound_ignores_the_new_request", "total = sum(r.in_flight for r in replicas) + 1",
               "total = sum(r.in_flight for r in replicas)"),
    PlantedBug("bound_rounded_down", "return math.ceil(c * total / len(replicas))", "return int(c * total / len(replicas))"),
    PlantedBug("bounded_load_ignored", "if url is not None and by_url[url].in_flight + 1 <= load_bound(replicas, c):",
               "if url is not None:"),
    PlantedBug("bound_checked_without_this_request", "by_url[url].in_flight + 1 <= load_bound(replicas, c)",
               "by_url[url].in_flight <= load_bound(replicas, c)"),
    PlantedBug("fallback_to_the_first_replica", "    return least_loaded(replicas)\n", "    return replicas[0]\n"),
    # predicted_long_threshold: the prefill at 100% of peak
    PlantedBug("threshold_at_full_peak", 'prefill_lower_bound(LLAMA_3_8B, "bf16", tokens, H100) / 0.4',
               'prefill_lower_bound(LLAMA_3_8B, "bf16", tokens, H100)'),
    # length_aware: the threshold itself counted short; short prompts allowed onto the long pool; no fallback
    PlantedBug("threshold_itself_short", "is_long = prompt_tokens >= threshold", "is_long = prompt_tokens > threshold"),
    PlantedBug("short_prompts_anywhere", "side = [r for r in replicas if (r.url in long_pool) == is_long]",
               "side = [r for r in replicas if r.url in long_pool] if is_long else list(replicas)"),
    PlantedBug("no_fallback_when_a_side_is_down", "return least_loaded(side or replicas)", "return least_loaded(side)"),
    PlantedBug("length_threshold_unchecked", "    if threshold < 1:\n", "    if False:\n"),
    # capstone_plan: LoRA on q and v only; TP=2 groups counted instead of GPUs; the host cache in GiB
    PlantedBug("capstone_lora_on_q_and_v_only",
               "((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))", "((h + q) + (h + kv))"),
    PlantedBug("capstone_tp2_groups_not_gpus", '"long_gpus_tp2": 2 * math.ceil(', '"long_gpus_tp2": math.ceil('),
    PlantedBug("capstone_host_cache_in_gib", 'adapter / 1e9}', 'adapter / 2**30}'),
]

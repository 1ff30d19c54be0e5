"""Planted bugs for lab 17_coding_round: mistakes a candidate makes under the clock. Each must fail a graded
test; the ones that hang (a lost wake-up, a lock held across the step, a drain that never ends) fail within the
tests' bounded waits (5 s), well inside the 20 s limit of a bug run."""
from grader.bugs import PlantedBug

I12, I16, I20 = " " * 12, " " * 16, " " * 20  # the solution's indentation levels
KEY = "return (self._skips[rid] < self.max_skips, deadline, arrival, rid)"
STEP_INPUTS = f"{I16}inputs = [(r.request_id, r.prompt + r.output) for r in batch]\n"

BUGS = [
    # ContinuousBatcher
    PlantedBug("lost_wakeup_submit_never_notifies",
               f"{I12}self._waiting.append(request)\n{I12}self._has_work.notify()\n",
               f"{I12}self._waiting.append(request)\n"),
    PlantedBug("lost_wakeup_admission_never_notifies_submitters",
               f"{I12}self._running[request.request_id] = request\n{I12}self._not_full.notify()\n",
               f"{I12}self._running[request.request_id] = request\n"),
    PlantedBug("lock_held_across_the_model_step", f"{STEP_INPUTS}{I12}tokens = ", f"{STEP_INPUTS}{I16}tokens = "),
    PlantedBug("busy_wait_instead_of_a_condition", f"{I20}self._has_work.wait()\n",
               f"{I20}self._lock.release()\n{I20}self._lock.acquire()\n"),
    PlantedBug("abort_delivers_the_in_flight_token_and_frees_twice",
               f"{I20}if self._running.get(request.request_id) is not request:\n",
               f"{I20}if request.stream.finish_reason == \"cancelled\":\n"),
    PlantedBug("non_monotonic_stream_pops_the_newest_token", "return self._items.popleft()",
               "return self._items.pop()"),
    PlantedBug("abort_of_a_waiting_request_leaves_it_queued", f"{I16}self._waiting.remove(request)\n", ""),
    PlantedBug("budget_ignores_the_running_decodes", "budget = self.token_budget - len(self._running)\n",
               "budget = self.token_budget\n"),
    PlantedBug("static_batching_admits_only_into_an_empty_batch", "budget = self.token_budget - len(self._running)\n",
               "budget = 0 if self._running else self.token_budget\n"),
    PlantedBug("close_stops_without_draining", f"{I16}if not (self._waiting or self._running):\n",
               f"{I16}if self._closing is not None or not (self._waiting or self._running):\n"),
    PlantedBug("queue_full_ignores_the_timeout",
               'raise QueueFull(f"{self.max_waiting} requests waiting for {timeout} s")', "pass"),
    # PriorityBatcher
    PlantedBug("starvation_no_bound", KEY, "return (True, deadline, arrival, rid)"),
    PlantedBug("priority_orders_by_arrival_not_deadline", KEY,
               "return (self._skips[rid] < self.max_skips, arrival, deadline, rid)"),
    PlantedBug("no_length_aware_packing", f"{I12}elif self._skips[rid] >= self.max_skips:\n", f"{I12}elif True:\n"),
    # StridedTensor
    PlantedBug("slice_offset_ignores_the_stride", f"{I16}offset += start * s\n", f"{I16}offset += start\n"),
    PlantedBug("slice_step_keeps_the_stride", "strides.append(s * step)", "strides.append(s)"),
    PlantedBug("view_assumes_contiguous", "strides = _view_strides(self.shape, self.strides, shape)",
               "strides = list(_contiguous_strides(shape))"),
    PlantedBug("permute_moves_sizes_not_strides", "[self.strides[d] for d in dims]", "self.strides"),
    PlantedBug("broadcast_without_zero_strides", "[0 if n == 1 else s for n, s in zip(self.shape, self.strides)]",
               "list(self.strides)"),
    # design questions
    PlantedBug("lock_held_during_step_answer", '"lock_during_step": "b"', '"lock_during_step": "a"'),
    PlantedBug("static_batching_step_count", "return (13, 16)", "return (13, 13)"),
]

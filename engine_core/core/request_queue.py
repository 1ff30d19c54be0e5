"""The waiting queue, ordered by `scheduling_policy` (vLLM v1's `core/sched/request_queue.py`).

The scheduler and the labs' seams (`_admit_waiting`, `_preempt`) use it as the deque it has always
been: `append` (a new request), `appendleft` (a request preempted for recompute), `[0]` and
`popleft()` (the next one to admit), `remove`, `len`, iteration. The policy lives here, where
requests enter the queue, so the seams' contracts do not change with it:

- "fcfs": a plain deque. New requests join the back, a recompute-preempted one the front.
- "priority": always sorted by (priority, arrival_time), lower first. Both appends insert at the
  request's place by that key, so a preempted request keeps its place: ahead of every later arrival
  of its priority, behind every more important request. Equal keys keep insertion order.

Starvation: like vLLM, priority is strict, with no aging. A request is admitted only from the head,
so under a steady stream of more important requests that keeps the batch full (`max_num_seqs`, the
token budget or the KV blocks), a low-priority request waits for as long as the stream lasts; it
runs as soon as a step has room after every more important waiting request is admitted. Once
running it is not displaced by arrivals (admission never preempts), but it is the first victim
when blocks run out, and then waits again behind them. The bound on its wait is the stream's, not
the scheduler's: `tests/core/test_request_queue.py` measures it.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, Iterator

from engine_core.config import SCHEDULING_POLICIES
from engine_core.request import Request


class FCFSRequestQueue(deque):
    """First-come first-served: a deque of requests (arrival order, recompute-preempted at the front)."""


class PriorityRequestQueue:
    """Requests sorted by (priority, arrival_time), lower first, with the deque methods the scheduler uses."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._keys: list[tuple[int, float]] = []
        self._requests: list[Request] = []
        for request in requests:
            self.append(request)

    # seam: lab 12 (grader/seams.py)
    def append(self, request: Request) -> None:
        """Insert at the request's place by (priority, arrival_time), after equal keys."""
        key = (request.priority, request.arrival_time)
        pos = bisect.bisect_right(self._keys, key)
        self._keys.insert(pos, key)
        self._requests.insert(pos, request)

    def appendleft(self, request: Request) -> None:
        """A preempted request goes back to its place by key, not to the front."""
        self.append(request)

    def popleft(self) -> Request:
        if not self._requests:
            raise IndexError("pop from an empty PriorityRequestQueue")
        del self._keys[0]
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        pos = next((i for i, r in enumerate(self._requests) if r is request), None)
        if pos is None:
            raise ValueError(f"request {request.request_id!r} is not in the queue")
        del self._keys[pos]
        del self._requests[pos]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._requests)

    def __repr__(self) -> str:
        return f"PriorityRequestQueue({[r.request_id for r in self._requests]})"


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """An empty waiting queue for `policy` ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")

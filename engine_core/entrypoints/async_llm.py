"""AsyncLLM: LLMEngine's step loop on its own thread; requests come and go from any thread or task.

The engine is single-threaded (engine_core.guard), so one thread, the loop, is its only caller:
callers never touch it, they put commands in a thread-safe inbox that the loop drains between
steps (add, abort, or any function of the engine, e.g. its stats). `generate()` is an async
iterator of a request's outputs; each request has a one-slot mailbox the loop overwrites, and an
output carries the request's cumulative tokens, so a slow reader builds no backlog: it gets the
latest output, and always the final one.

Back-pressure: an add is refused (QueueFullError) while `max_waiting_requests` requests wait for
admission. A reader that goes away (its task cancelled, the iterator closed) aborts its request,
which frees its blocks. A step that raises fails every request in flight (EngineStepError in
each iterator, the requests aborted) and the loop goes on with new ones. A dead engine (EngineDeadError:
a worker process failed, in a step or between steps, as the executor's failure callback reports) ends
the loop: the requests in flight and every later call get EngineDeadError with the reason, and
`is_running` is False (a server's /health answers 503). `shutdown()` refuses new
requests, lets those in flight finish (or aborts them at once, or at the timeout) and joins the
thread. Scheduling order is the engine's `scheduling_policy`: `priority` goes to add_request as it
is, which refuses one other than 0 under "fcfs" (generate raises its ValueError, nothing queued).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from engine_core.engine import LLMEngine
from engine_core.exceptions import EngineDeadError
from engine_core.lora.request import LoRARequest
from engine_core.prompts import PromptType
from engine_core.request import Request, RequestOutput, SamplingParams
from engine_core.validation import check_int

T = TypeVar("T")
logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is full: the request was refused, nothing was queued (retry later)."""


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in flight; the request was aborted."""


class _Mailbox:
    """One slot, written by the loop thread, read by one asyncio task: the latest output wins."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._lock = threading.Lock()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._closed = False  # the final output or an error was put: later writes are dropped

    def put(self, output: RequestOutput) -> None:
        with self._lock:
            if self._closed:
                return
            self._output, self._closed = output, output.finished
        self._wake()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self._closed:
                return
            self._error, self._closed = error, True
        self._wake()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the reader's event loop is closed: nobody is listening
            pass

    async def get(self) -> RequestOutput:
        while True:
            self._event.clear()  # before looking: a put after the look sets it again
            with self._lock:
                output, self._output = self._output, None
                error = self._error
            if error is not None:
                raise error
            if output is not None:
                return output
            await self._event.wait()


@dataclass
class _Stream:
    mailbox: _Mailbox
    request: Request
    prompt: str | None


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    priority: int
    mailbox: _Mailbox
    future: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


class AsyncLLM:
    """`AsyncLLM.from_kwargs(model, max_waiting_requests=..., **engine args)`, or around an engine
    that no other thread touches from then on. `engine` is public for reading its fixed facts
    (tokenizer, config); everything that reads or changes state goes through `run_in_engine`."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256, idle_poll_s: float = 1.0) -> None:
        self.max_waiting_requests = check_int("max_waiting_requests", max_waiting_requests, 1,
                                              hint="a new request waits until the next step, so at least 1")
        self.engine = engine
        self._idle_poll_s = idle_poll_s
        self._inbox: collections.deque[_Add | _Abort | _Call] = collections.deque()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # orders `_closed` against inbox appends
        self._closed = False  # the loop has exited: nothing more is accepted
        self._stopping = False  # shutdown started: adds are refused
        self._abort_all = False
        self._deadline = float("inf")  # shutdown: in-flight requests are aborted after this
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self.num_step_errors = 0
        self._dead: str | None = None  # why the engine cannot step again (any thread may set it, once)
        engine.executor.register_failure_callback(self._engine_died)
        self._thread = threading.Thread(target=self._run, name="AsyncLLM-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str, max_waiting_requests: int = 256, **engine_args: Any) -> "AsyncLLM":
        return cls(LLMEngine.from_kwargs(model, **engine_args), max_waiting_requests)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def is_running(self) -> bool:
        return not self._stopping and not self._closed and self._dead is None

    # ---- the callers' side (any thread) ----------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, the last one `.finished`. The first `__anext__` raises what
        add_request raises (ValueError naming the parameter), QueueFullError or EngineDeadError,
        and then nothing is queued. Leaving early (break, a cancelled task) aborts the request."""
        mailbox = _Mailbox(asyncio.get_running_loop())
        future: concurrent.futures.Future = concurrent.futures.Future()
        finished = False
        self._submit(_Add(request_id, prompt, sampling_params, priority, mailbox, future, lora_request))
        try:
            await asyncio.wrap_future(future)
            while not finished:
                output = await mailbox.get()
                finished = output.finished
                yield output
        except (ValueError, QueueFullError, EngineDeadError):
            finished = True  # refused: nothing of it is in the engine
            raise
        finally:
            if not finished:  # a cancelled add too: the abort is queued after it, so it lands
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort from any thread or task, without waiting: the request's iterator ends with an
        output whose finish_reason is "abort". Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            try:
                self._submit(_Abort(rid))
            except EngineDeadError:
                return  # nothing left to abort: the loop aborted everything on its way out

    def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> "concurrent.futures.Future[T]":
        """`fn(engine)` on the loop thread, between steps; after shutdown, in the caller's thread
        (no loop is left to race with)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(_Call(fn, future))
        except EngineDeadError:
            if self._thread.is_alive():
                raise
            _settle(future, fn, self.engine)
        return future

    def stats(self, timeout: float = 10.0) -> dict[str, float]:
        """LLMEngine.stats(), taken between steps (blocks the calling thread up to one step)."""
        return self.run_in_engine(LLMEngine.stats).result(timeout)

    def prometheus_metrics(self, timeout: float = 10.0) -> str:
        return self.run_in_engine(LLMEngine.prometheus_metrics).result(timeout)

    def shutdown(self, timeout: float = 10.0, abort: bool = False) -> bool:
        """Refuse new requests; let those in flight finish (`abort=True`: abort them now), aborting
        what is left after `timeout` seconds; then join the loop. True if the thread ended (False:
        a step outlived the timeout and a second one; the thread is a daemon)."""
        self._deadline = time.monotonic() + timeout
        self._stopping = True
        self._abort_all = self._abort_all or abort
        self._wakeup.set()
        self._thread.join(timeout + 5.0)
        return not self._thread.is_alive()

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is dead, no new requests are accepted: {self._dead}")
            if self._closed or (self._stopping and isinstance(command, _Add)):
                raise EngineDeadError("the engine loop is shut down: no new requests are accepted")
            self._inbox.append(command)
        self._wakeup.set()

    def _engine_died(self, reason: str) -> None:
        """The executor's failure callback (its monitor thread): the loop ends at its next turn."""
        if self._dead is None:
            self._dead = reason
        self._wakeup.set()

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._dead is None:
                self._drain_inbox()
                if self._stopping and (self._abort_all or time.monotonic() >= self._deadline):
                    self._abort_streams(list(self._streams))
                if self._stopping and not self._streams and not self.engine.has_unfinished_requests():
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wakeup.wait(self._idle_poll_s)
                    self._wakeup.clear()
        finally:
            self._close()

    def _drain_inbox(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, (_Add, _Call)) and not command.future.set_running_or_notify_cancel():
                continue  # its caller was cancelled while it waited here (asyncio.wrap_future cancels it)
            try:
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Abort):
                    self._abort_streams([command.request_id])
                else:
                    _settle(command.future, command.fn, self.engine)
            except Exception as e:  # a fault of ours must not kill the loop: the command's caller hears of it
                if isinstance(command, (_Add, _Call)) and not command.future.done():
                    command.future.set_exception(e)
                else:
                    logger.exception("AsyncLLM: %r failed", command)

    def _add(self, command: _Add) -> None:
        if self._stopping:
            command.future.set_exception(EngineDeadError("the engine loop is shutting down: request refused"))
            return
        waiting = self.engine.stats()["num_requests_waiting"]
        if waiting >= self.max_waiting_requests:
            command.future.set_exception(QueueFullError(
                f"{int(waiting)} requests are waiting for admission (max_waiting_requests="
                f"{self.max_waiting_requests}); request {command.request_id!r} refused, retry later"))
            return
        try:
            request = self.engine.add_request(command.request_id, command.prompt, command.params, command.priority,
                                              lora_request=command.lora_request)
        except Exception as e:  # ValueError names the parameter; anything else is reported, never lost
            command.future.set_exception(e)
            return
        self._streams[command.request_id] = _Stream(command.mailbox, request, _prompt_text(command.prompt))
        command.future.set_result(None)

    def _abort_streams(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._streams]
        if not ids:
            return
        self.engine.abort_request(ids)
        for rid in ids:
            stream = self._streams.pop(rid)
            stream.mailbox.put(self.engine.make_output(stream.request, stream.prompt))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:  # no step can run again: the loop ends, _close fails every request
            self._engine_died(str(e))
            return
        except Exception as e:  # the engine rolled itself back; its requests are failed, not retried forever
            self.num_step_errors += 1
            streams, self._streams = self._streams, {}
            self.engine.abort_request(list(streams))
            for rid, stream in streams.items():
                error = EngineStepError(f"request {rid!r} aborted: an engine step raised {type(e).__name__}: {e}")
                error.__cause__ = e
                stream.mailbox.fail(error)
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.mailbox.put(output)
                if output.finished:
                    del self._streams[output.request_id]

    def _close(self) -> None:
        """On the way out (shutdown, or the loop died): refuse everything, answer every waiter."""
        with self._lock:
            self._closed = True
        dead = EngineDeadError(f"the engine is dead: {self._dead}" if self._dead else "the engine loop stopped")
        for command in self._inbox:
            if isinstance(command, (_Add, _Call)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(dead)
        self._inbox.clear()
        try:
            self.engine.abort_request(list(self._streams))
        finally:
            for stream in self._streams.values():
                stream.mailbox.fail(dead)
            self._streams.clear()
            if self._dead is not None:  # the surviving workers are stopped now, not at the server's exit
                self.engine.shutdown()


def _settle(future: concurrent.futures.Future, fn: Callable[[LLMEngine], Any], engine: LLMEngine) -> None:
    try:
        future.set_result(fn(engine))
    except Exception as e:
        future.set_exception(e)


def _prompt_text(prompt: PromptType) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None

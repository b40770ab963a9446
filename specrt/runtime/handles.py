"""A request submitted to a `Service`: its text deltas as they come (from a thread, or with
``async for`` from asyncio, never blocking the event loop), its result, its cancellation, and
callbacks for when it is done and for each gap between its tokens (the server's metrics)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from specrt.errors import InvalidInputError, SpecrtError
from specrt.runtime.batching import Request
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.results import GenerationResult
from specrt.runtime.streaming import TextDeltas
from specrt.validation import number

log = logging.getLogger("specrt")


@dataclass(frozen=True)
class Delta:
    """A piece of a request's text, with the log-probabilities of the tokens that came since
    the piece before (None where the request asks for none). A round whose text is all held
    back (half a character, the start of a stop string) hands its entries to the next piece;
    the last piece may bring entries alone (empty text)."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    token_ids: tuple[int, ...] = ()  # the new tokens since the piece before


class RequestHandle:
    """One submitted request: its text deltas as they come, its result, its cancellation.

    Deltas concatenate to the result's text exactly. Iterate it once (from a thread, or with
    ``async for`` from asyncio): the text pieces, or `deltas` / `adeltas` for `Delta` s with
    their log-probabilities; ``per_token=True`` at submit hands out one delta per token
    instead of one per round."""

    def __init__(self, key: int, request: Request, deltas: TextDeltas, per_token: bool) -> None:
        self.key = key
        self.request = request
        self.priority = 0  # set by the service: lower leaves its queue first ("priority")
        self._text = deltas
        self._per_token = per_token
        self._sent_tokens = 0
        self._sent_ids = 0  # new tokens handed out with the deltas so far
        self._sent_logprobs = 0  # entries handed out with the deltas so far
        self._prompt_logprobs: list[TokenLogprob | None] | None = None  # set as it is admitted
        self._deltas: list[Delta] = []
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        # Set by the service that queued it: takes it out of the queue (weak, so that a handle
        # kept by a caller does not keep its service alive)
        self._withdraw: weakref.WeakMethod | None = None
        self._changed = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._callbacks: list[Callable[[RequestHandle], None]] = []
        self._gap_callbacks: list[Callable[[float], None]] = []
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None  # when it left the queue for the batch
        self.first_text_at: float | None = None  # when its first text was handed out
        # When rounds gave it tokens (the metrics' prefill, decode and inter-token times)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_gaps: list[float] = []  # between rounds that gave it tokens

    # For the consumer --------------------------------------------------------------------
    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities where the config asks for them
        (``prompt_logprobs``), once the request is admitted (before its first delta)."""
        if self._prompt_logprobs is None and self._result is not None:
            return self._result.prompt_logprobs
        return self._prompt_logprobs

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def add_done_callback(self, callback: Callable[[RequestHandle], None]) -> None:
        """Call ``callback(handle)`` when the request ends (finished, cancelled or failed), from
        the service's thread; at once if it has ended."""
        _callable("callback", callback)
        with self._changed:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self)

    def add_gap_callback(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(seconds)`` for each gap between rounds that give the request
        tokens, as it comes (from the service's thread), so a long request's inter-token
        times are seen while it runs; the gaps before this call are passed at once."""
        _callable("callback", callback)
        with self._changed:
            self._gap_callbacks.append(callback)
            past = list(self.token_gaps)
        for gap in past:
            callback(gap)

    def cancel(self) -> None:
        """Stop generating: a request still waiting for a slot ends now (its place in the queue
        freed for others), a running one at the next round boundary; the result keeps what
        was made."""
        self._cancelled = True
        withdraw = self._withdraw() if self._withdraw is not None else None
        if withdraw is not None:
            withdraw(self)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish; its result (finish reason "cancelled" if it was).
        A ``timeout`` that passes raises `TimeoutError` and leaves the request running."""
        timeout = seconds("timeout", timeout)
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.key} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __iter__(self) -> Iterator[str]:
        for delta in self.deltas():
            if delta.text:
                yield delta.text

    async def __aiter__(self) -> AsyncIterator[str]:
        async for delta in self.adeltas():
            if delta.text:
                yield delta.text

    def deltas(self) -> Iterator[Delta]:
        """The text pieces with their tokens' log-probabilities, from a thread."""
        seen = 0
        try:
            while True:
                with self._changed:
                    while len(self._deltas) <= seen and not self.done:
                        self._changed.wait()
                    fresh, finished = self._deltas[seen:], self.done
                seen += len(fresh)
                yield from fresh
                if finished and seen == len(self._deltas):
                    break
            if self._error is not None:
                raise self._error
        finally:
            if not self.done:  # the consumer stopped early: free the slot
                self.cancel()

    async def adeltas(self) -> AsyncIterator[Delta]:
        """`deltas` for asyncio, never blocking the event loop."""
        loop = asyncio.get_running_loop()
        seen = 0
        waiter = None
        try:
            while True:
                with self._changed:
                    fresh, finished = self._deltas[seen:], self.done
                    waiter = None
                    if not fresh and not finished:
                        waiter = loop.create_future()
                        self._waiters.append((loop, waiter))
                if waiter is not None:
                    await waiter
                    continue
                seen += len(fresh)
                for delta in fresh:
                    yield delta
                if finished and seen == len(self._deltas):
                    break
            if self._error is not None:
                raise self._error
        finally:
            if not self.done:
                self.cancel()
            with self._changed:  # a consumer gone (its task cancelled, its loop closed)
                self._waiters = [(lp, w) for lp, w in self._waiters if w is not waiter]

    async def wait(self) -> GenerationResult:
        """The result, awaited without blocking the event loop. Cancelling the awaiting task
        (``asyncio.wait_for`` timing out included) cancels the request, as dropping an
        iterator does; ``asyncio.shield`` keeps it running."""
        async for _ in self:
            pass
        return self.result()

    # For the service thread --------------------------------------------------------------
    def _progress(
        self,
        new_ids: list[int],
        now: float | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """``now``: when the round that gave ``new_ids`` ended (one time for all its rows);
        ``logprobs``: the row's entries so far, where its config asks for them."""
        if len(new_ids) > self._sent_tokens:
            self._tokens_came(now)
        if self._per_token:
            counts = range(self._sent_tokens + 1, len(new_ids) + 1)
            pieces = [(self._text.update(new_ids[:n]), n) for n in counts]
        else:
            pieces = [(self._text.update(new_ids), len(new_ids))]
        self._sent_tokens = len(new_ids)
        deltas = [self._delta(text, logprobs, n, new_ids, n) for text, n in pieces if text]
        self._publish(deltas)

    def _finish(
        self,
        result: GenerationResult | None,
        error: BaseException | None = None,
        now: float | None = None,
    ) -> None:
        """The rest of the text (the last round's tokens, cut before a stop string) in one
        delta, with the entries not handed out yet, and the result."""
        if result is not None and len(result.token_ids) > self._sent_tokens:
            self._tokens_came(now)
        tail = self._text.finish(result.text) if result is not None else ""
        logprobs = result.logprobs if result is not None else None
        ids = result.token_ids if result is not None else []
        last = self._delta(tail, logprobs, len(logprobs or ()), ids, len(ids))
        self._publish([last] if tail or last.logprobs else [], result, error)

    def _delta(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        upto: int,
        ids: list[int],
        count: int,
    ) -> Delta:
        """``text`` with the entries of ``logprobs`` up to ``upto`` and the first ``count``
        of the request's new tokens ``ids`` not handed out yet."""
        new = tuple(ids[self._sent_ids : count])
        self._sent_ids = max(self._sent_ids, count)
        if logprobs is None:
            return Delta(text, token_ids=new)
        entries = logprobs[self._sent_logprobs : upto]
        self._sent_logprobs = max(self._sent_logprobs, upto)
        return Delta(text, entries, new)

    def _tokens_came(self, now: float | None) -> None:
        now = time.perf_counter() if now is None else now
        if self.last_token_at is None:
            self.first_token_at = now
            self.last_token_at = now
            return
        gap = now - self.last_token_at
        with self._changed:
            self.token_gaps.append(gap)
            callbacks = list(self._gap_callbacks)
        self.last_token_at = now
        for callback in callbacks:
            try:
                callback(gap)
            except Exception:  # a caller's bug must not stop the service
                log.exception("specrt service: a gap callback failed")

    def _publish(self, deltas: list[Delta], result=None, error=None) -> None:
        callbacks = []
        with self._changed:
            if any(delta.text for delta in deltas) and self.first_text_at is None:
                self.first_text_at = time.perf_counter()
            self._deltas.extend(deltas)
            if result is not None:
                self._result = result
            if error is not None:
                self._error = error
            if self.done:
                callbacks, self._callbacks = self._callbacks, []
        # The done callbacks before the consumers wake: a client that has its answer finds
        # its request in the metrics.
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a caller's bug must not stop the service
                log.exception("specrt service: a done callback failed")
        with self._changed:
            self._changed.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # its event loop is closed: nobody is waiting there
                pass


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta | None]]:
    """``(i, delta)`` as handle i's `Delta` s come, and ``(i, None)`` as it ends (an OpenAI
    request's ``n`` choices in one stream); a handle's error is raised. Leaving early closes
    every handle's iterator (cancelling it)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for delta in handle.adeltas():
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except SpecrtError as exc:
            queue.put_nowait((index, exc))

    pumps = [asyncio.ensure_future(pump(i, handle)) for i, handle in enumerate(handles)]
    try:
        ended = 0
        while ended < len(handles):
            index, delta = await queue.get()
            if isinstance(delta, SpecrtError):
                raise delta
            ended += delta is None
            yield index, delta
    finally:
        for task in pumps:
            task.cancel()


def seconds(name: str, value: object) -> float | None:
    """A timeout in seconds (None: none), checked where it is given, not deep in `threading`."""
    return None if value is None else number(name, value, "use seconds >= 0, or None", _positive)


def _positive(value: float) -> bool:
    return value >= 0


def _callable(name: str, value: object) -> None:
    if not callable(value):  # it would fail later, on the service's thread, unseen
        raise InvalidInputError(f"{name} must be callable, not {type(value).__name__}")


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)

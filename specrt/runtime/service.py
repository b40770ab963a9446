"""One generator shared by many threads or asyncio tasks: requests in, text deltas out.

`Service.submit` queues a request and returns its `RequestHandle` at once. A background thread
admits waiting requests into the batch between rounds (continuous batching over
`batching.BatchRunner`), runs rounds, and hands each request the text its accepted tokens add
(`streaming.TextDeltas`). A handle is iterated for deltas (``for delta in handle`` or
``async for delta in handle``, which never blocks the event loop), waited on for the result,
or cancelled: explicitly, or by dropping its iterator; its slot is freed at the next round
boundary. When the batch and the waiting queue are full, `submit` raises `OverloadedError`.
A service holds its generator until `close` (or the end of its ``with`` block); one dropped
without either lets go of it, and its thread ends, within a second of going idle.

    with Service(SpeculativeGenerator.from_bundle("engines/demo", max_batch=8)) as service:
        handle = service.submit("def fibonacci(n):", GenerationConfig(max_new_tokens=64))
        for delta in handle:
            print(delta, end="", flush=True)
        print(handle.result().stats.acceptance_rate)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from specrt.backends import RowsDecoder
from specrt.backends.portable import PortableDecoder
from specrt.errors import InvalidInputError, NumericalError, OverloadedError, SpecrtError
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import Prompt, SpeculativeGenerator
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.runtime.streaming import TextDeltas
from specrt.validation import flag, integer

log = logging.getLogger("specrt")
IDLE_CHECK_S = 1.0  # how often an idle service thread looks whether its service was dropped
DEFAULT_MAX_WAITING = 64


class RequestHandle:
    """One submitted request: its text deltas as they come, its result, its cancellation.

    Deltas concatenate to the result's text exactly. Iterate it once (from a thread, or with
    ``async for`` from asyncio); ``per_token=True`` at submit hands out one delta per token
    instead of one per round."""

    def __init__(self, key: int, request: Request, deltas: TextDeltas, per_token: bool) -> None:
        self.key = key
        self.request = request
        self._text = deltas
        self._per_token = per_token
        self._sent_tokens = 0
        self._deltas: list[str] = []
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._cancelled = False
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
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def add_done_callback(self, callback: Callable[[RequestHandle], None]) -> None:
        """Call ``callback(handle)`` when the request ends (finished, cancelled or failed), from
        the service's thread; at once if it has ended."""
        with self._changed:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self)

    def add_gap_callback(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(seconds)`` for each gap between rounds that give the request
        tokens, as it comes (from the service's thread), so a long request's inter-token
        times are seen while it runs; the gaps before this call are passed at once."""
        with self._changed:
            self._gap_callbacks.append(callback)
            past = list(self.token_gaps)
        for gap in past:
            callback(gap)

    def cancel(self) -> None:
        """Stop generating (at the next round boundary); the result keeps what was made."""
        self._cancelled = True

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish; its result (finish reason "cancelled" if it was).
        A ``timeout`` that passes raises `TimeoutError` and leaves the request running."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.key} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __iter__(self) -> Iterator[str]:
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

    async def __aiter__(self) -> AsyncIterator[str]:
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
    def _progress(self, new_ids: list[int], now: float | None = None) -> None:
        """``now``: when the round that gave ``new_ids`` ended (one time for all its rows)."""
        if len(new_ids) > self._sent_tokens:
            self._tokens_came(now)
        if self._per_token:
            counts = range(self._sent_tokens + 1, len(new_ids) + 1)
            pieces = [self._text.update(new_ids[:n]) for n in counts]
        else:
            pieces = [self._text.update(new_ids)]
        self._sent_tokens = len(new_ids)
        self._publish([p for p in pieces if p])

    def _finish(
        self,
        result: GenerationResult | None,
        error: BaseException | None = None,
        now: float | None = None,
    ) -> None:
        """The rest of the text (the last round's tokens, cut before a stop string) in one
        delta, and the result."""
        if result is not None and len(result.token_ids) > self._sent_tokens:
            self._tokens_came(now)
        tail = self._text.finish(result.text) if result is not None else ""
        self._publish([tail] if tail else [], result, error)

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

    def _publish(self, deltas: list[str], result=None, error=None) -> None:
        callbacks = []
        with self._changed:
            if deltas and self.first_text_at is None:
                self.first_text_at = time.perf_counter()
            self._deltas.extend(deltas)
            if result is not None:
                self._result = result
            if error is not None:
                self._error = error
            if self.done:
                callbacks, self._callbacks = self._callbacks, []
            self._changed.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # its event loop is closed: nobody is waiting there
                pass
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a caller's bug must not stop the service
                log.exception("specrt service: a done callback failed")


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Service:
    """Continuous batching over one generator for many concurrent callers (see the module).

    ``max_waiting``: requests that may wait for a slot (0: none, a request is taken only
    while a slot is free); beyond that `submit` raises `OverloadedError`."""

    def __init__(
        self, generator: SpeculativeGenerator, max_waiting: int = DEFAULT_MAX_WAITING
    ) -> None:
        if not isinstance(generator, SpeculativeGenerator):
            raise InvalidInputError(
                f"a Service runs a SpeculativeGenerator, not {type(generator).__name__} (load "
                "one with SpeculativeGenerator.from_bundle(path, max_batch=8))"
            )
        draft = getattr(generator.drafter, "decoder", None)
        if not (isinstance(generator.target, RowsDecoder) and isinstance(draft, RowsDecoder)):
            portable = isinstance(generator.target, PortableDecoder)
            raise InvalidInputError(
                "the service runs the portable graph batched: load it with max_batch >= 2 "
                "(specrt serve --batch-size 2 or more)"
                if portable
                else "the service runs the onnxruntime or cuda engine or the portable graph "
                "(batched decoders); the TensorRT engines, Gemma 2's cuda engine and cuda engines "
                "built by earlier versions of specrt run one row per call (rebuild those: specrt "
                "build --bundle DIR --device cuda)"
            )
        max_waiting = integer("max_waiting", max_waiting, 0)
        # The caches are the service's alone: another service, or a direct call, on the same
        # generator would overwrite its rows.
        generator._serve(self)
        self.generator = generator
        self.max_waiting = max_waiting
        self._runner = BatchRunner(
            generator.target,
            draft,
            generator.tokenizer,
            generator.eos_token_ids,
            generator.suffix_cache,
            one_row=generator.one_row,
        )
        self._runner.schedules = generator._load_schedules
        for decoder in (generator.target, draft):  # no request pays for the cache's memory
            decoder.reserve()
        self._waiting: deque[RequestHandle] = deque()
        self._running: dict[int, RequestHandle] = {}
        self._keys = itertools.count()
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def cache_usage(self) -> float:
        """The share of the target's KV cache positions (every slot at its most) that the
        running rows hold, 0 to 1."""
        target, slots = self.generator.target, self._runner.max_batch
        return float(target.lengths[:slots].sum()) / (slots * target.max_positions)

    def submit(
        self, prompt: Prompt, config: GenerationConfig | None = None, per_token: bool = False
    ) -> RequestHandle:
        """Queue a request (its prompt checked now); returns its handle. A seeded request
        samples from the stream ``(seed, 0)``, as `SpeculativeGenerator.generate` does for a
        single prompt, so it is reproducible whatever else runs."""
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise InvalidInputError(
                f"config must be a GenerationConfig, not {type(config).__name__}"
            )
        if isinstance(prompt, (list, tuple)) and any(isinstance(p, str) for p in prompt):
            raise InvalidInputError(
                "submit takes one prompt (a string, or a list of token ids), not a list of "
                "strings: submit each"
            )
        [ids] = self.generator.encode_prompts([prompt])
        per_token = flag("per_token", per_token)
        if config.stop and self.generator.tokenizer is None:
            raise InvalidInputError("stop strings need the bundle's tokenizer")
        rng = np.random.default_rng(None if config.seed is None else [config.seed, 0])
        key = next(self._keys)
        request = Request(key, ids, config, rng)
        tokenizer = self.generator.tokenizer
        decode = tokenizer.incremental() if tokenizer is not None else _no_text
        handle = RequestHandle(key, request, TextDeltas(decode, config.stop), per_token)
        with self._wake:
            if self._closing:
                raise OverloadedError("the service is shutting down: not accepting requests")
            # Requests queued for the slots free now are not waiting: those past them are.
            free = max(0, self._runner.max_batch - len(self._running))
            if len(self._waiting) - free >= self.max_waiting:
                raise OverloadedError(
                    f"overloaded: {self.running} requests running and {len(self._waiting)} "
                    "waiting; retry later"
                )
            self._waiting.append(handle)
            self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_service_thread,
                    args=(weakref.ref(self),),
                    name="specrt-service",
                    daemon=True,
                )
                self._thread.start()
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Stop admitting; let running and waiting requests finish (within ``timeout``
        seconds, after which they are cancelled), then stop the thread. From a done callback
        (the service's own thread) it returns at once: the thread stops, and lets go of the
        generator, once the requests left are done."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        thread = self._thread
        if thread is threading.current_thread():  # it cannot wait for itself
            return
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                for handle in [*self._waiting, *self._running.values()]:
                    handle.cancel()
                with self._wake:
                    self._wake.notify()
                thread.join()
        self.generator._serve(None)  # direct calls may use the caches again

    # The service thread ------------------------------------------------------------------
    def _pass(self) -> bool:
        """One pass of the service thread (`_service_thread`): admit, then a round; False
        once it is done (closing, nothing left)."""
        with self._wake:
            self._wake.wait_for(self._has_work, IDLE_CHECK_S)
            if not (self._waiting or self._running):
                if not self._closing:
                    return True  # idle: the thread lets go of the service for a moment
                self.generator._serve(None)  # closing, nothing left: the generator is free
                return False
            admitted = self._take()
        try:
            with self.generator._lock:
                while admitted:  # those that came during an admission do not wait a round
                    self._admit(admitted)
                    with self._wake:
                        admitted = self._take()
                self._drop_cancelled()
                if self._running:
                    self._round()
        except SpecrtError as exc:  # a model failure: fail what ran, keep serving
            log.error("specrt service: %s", exc)
            self._fail_running(exc)
        except Exception as exc:  # a bug: its requests get an error, never a hang
            log.exception("specrt service: a round failed")
            self._fail_running(SpecrtError(f"internal error in the service: {exc!r}"))
        return True

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running or self._closing)

    def _take(self) -> list[RequestHandle]:
        """The waiting requests that fit in the free slots, out of the queue (under the lock)."""
        taken = []
        room = self._runner.max_batch - len(self._running)
        while self._waiting and len(taken) < room:
            taken.append(self._waiting.popleft())
        return taken

    def _fail_running(self, exc: SpecrtError) -> None:
        for key in list(self._running):
            try:
                self._runner.cancel(key)
            except Exception:  # noqa: BLE001 - the runner may be what broke; the slot is lost
                log.exception("specrt service: could not free a slot")
            self._running.pop(key)._finish(None, exc)

    def _admit(self, handles: list[RequestHandle]) -> None:
        """Prefill the admitted requests one after another, the shortest prompt first, and hand
        out each one's first token as soon as its own prefill is done: requests that finish
        in the same round come back together, and none waits for the others' prompts."""
        live = []
        for handle in handles:
            if handle._cancelled:
                handle._finish(_nothing(handle.request, "cancelled"))
            else:
                handle.admitted_at = time.perf_counter()
                live.append(handle)
                self._running[handle.key] = handle
        for handle in sorted(live, key=lambda h: len(h.request.prompt)):
            for request, result in self._runner.add([handle.request]):
                self._running.pop(request.key)._finish(result)
            if handle.key in self._running:  # its first token, out at once
                new_ids = next(ids for r, ids in self._runner.active() if r.key == handle.key)
                handle._progress(new_ids)

    def _drop_cancelled(self) -> None:
        for key, handle in list(self._running.items()):
            if handle._cancelled:
                result = self._runner.cancel(key)
                del self._running[key]
                handle._finish(result)

    def _round(self) -> None:
        finished = self._runner.step()
        now = time.perf_counter()  # when the round's tokens came, for every row alike
        for request, result in finished:
            handle = self._running.pop(request.key)
            if result.error is not None:  # NaN/inf logits in this request's row alone
                handle._finish(None, NumericalError(result.error))
            else:
                handle._finish(result, now=now)
        for request, new_ids in self._runner.active():
            self._running[request.key]._progress(new_ids, now)


def _service_thread(service_ref: weakref.ref) -> None:
    """The service's thread. It holds the service only while it works, so a service dropped
    without `close` is collected once idle (its generator free again) and the thread ends."""
    while True:
        service = service_ref()
        if service is None or not service._pass():
            return
        del service


def _no_text(ids: list[int]) -> str:
    return ""


def _nothing(request: Request, reason: str) -> GenerationResult:
    stats = GenerationStats(prompt_tokens=len(request.prompt))
    return GenerationResult("", [], reason, stats)

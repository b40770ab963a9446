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

import bisect
import itertools
import logging
import threading
import time
import weakref
from collections import deque

import numpy as np

from specrt.backends import RowsDecoder
from specrt.backends.portable import PortableDecoder
from specrt.errors import (
    InvalidInputError,
    NumericalError,
    OverloadedError,
    ServiceClosedError,
    SpecrtError,
)
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import Prompt, SpeculativeGenerator
from specrt.runtime.handles import RequestHandle, seconds
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.runtime.stopping import text_ids
from specrt.runtime.streaming import TextDeltas
from specrt.validation import flag, integer

log = logging.getLogger("specrt")
IDLE_CHECK_S = 1.0  # how often an idle service thread looks whether its service was dropped
DEFAULT_MAX_WAITING = 64
# vLLM's names: first come, first served; or the lowest ``priority`` first (then by arrival)
FCFS, PRIORITY = "fcfs", "priority"
PRIORITY_BOUND = 2**63  # priorities are 64-bit integers, of either sign


class Service:
    """Continuous batching over one generator for many concurrent callers (see the module).

    ``max_waiting``: requests that may wait for a slot (0: none, a request is taken only
    while a slot is free); beyond that `submit` raises `OverloadedError`.
    ``scheduling_policy``: "fcfs" takes waiting requests in the order they came; "priority"
    (vLLM's) takes the lowest ``priority`` given to `submit` first, in order of arrival among
    equals. A running request is never stopped for one waiting, whatever its priority."""

    def __init__(
        self,
        generator: SpeculativeGenerator,
        max_waiting: int = DEFAULT_MAX_WAITING,
        scheduling_policy: str = FCFS,
    ) -> None:
        if not isinstance(generator, SpeculativeGenerator):
            raise InvalidInputError(
                f"a Service runs a SpeculativeGenerator, not {type(generator).__name__} (load "
                "one with SpeculativeGenerator.from_bundle(path, max_batch=8))"
            )
        draft = generator.draft
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
        if scheduling_policy not in (FCFS, PRIORITY):
            raise InvalidInputError(
                f"scheduling_policy={scheduling_policy!r}: use 'fcfs' (first come, first "
                "served) or 'priority' (the lowest priority first)",
                "scheduling_policy",
            )
        self.scheduling_policy = scheduling_policy
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
            corpus=generator.corpus,
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
    def capacity(self) -> int:
        """Requests it holds at most at once: one a slot, and ``max_waiting`` queued."""
        return self._runner.max_batch + self.max_waiting

    @property
    def cache_usage(self) -> float:
        """The share of the target's KV cache positions (every slot at its most) that the
        running rows hold, 0 to 1."""
        target, slots = self.generator.target, self._runner.max_batch
        return float(target.lengths[:slots].sum()) / (slots * target.max_positions)

    def submit(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        per_token: bool = False,
        index: int = 0,
        priority: int = 0,
    ) -> RequestHandle:
        """Queue a request (its prompt checked now); returns its handle. A seeded request
        samples from the stream ``(seed, index)``, as `SpeculativeGenerator.generate` does for
        its row ``index``, so it is reproducible whatever else runs; ``index`` tells apart
        samples of one prompt under one seed (an OpenAI request's ``n`` choices).
        ``priority``: where the service schedules by priority, requests of a lower value leave
        the queue first (vLLM's); under "fcfs" only 0 is taken."""
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
        [ids] = self.generator.encode_prompts([prompt], config)
        per_token = flag("per_token", per_token)
        index = integer("index", index, 0)
        priority = integer("priority", priority, -PRIORITY_BOUND, PRIORITY_BOUND - 1)
        if priority and self.scheduling_policy == FCFS:
            raise InvalidInputError(
                f"priority={priority}: this service takes requests first come, first served; "
                "send 0, or start it with scheduling_policy='priority' (specrt serve "
                "--scheduling-policy priority)",
                "priority",
            )
        self.generator.check_config(config)
        rng = np.random.default_rng(None if config.seed is None else [config.seed, index])
        key = next(self._keys)
        request = Request(key, ids, config, rng)
        handle = RequestHandle(
            key, request, TextDeltas(self._decode(config), config.stop), per_token
        )
        handle._withdraw = weakref.WeakMethod(self._withdraw)
        handle.priority = priority
        with self._wake:
            if self._closing:
                raise ServiceClosedError(
                    "the service is shutting down or closed: it takes no more requests (start "
                    "a new Service on the generator)"
                )
            # Requests queued for the slots free now are not waiting: those past them are.
            free = max(0, self._runner.max_batch - len(self._running))
            queued = len(self._waiting) - free
            if queued >= self.max_waiting:
                running = len(self._running) + min(free, len(self._waiting))
                raise OverloadedError(
                    f"overloaded: {running} requests running and {queued} waiting; retry later"
                )
            # (priority, arrival): "fcfs" has every priority 0, so this is its order too
            bisect.insort(self._waiting, handle, key=lambda h: (h.priority, h.key))
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
        timeout = seconds("timeout", timeout)
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

    def _decode(self, config: GenerationConfig):
        """A growing row's text as its request shows it (`stopping.text_ids`)."""
        tokenizer = self.generator.tokenizer
        if tokenizer is None:
            return _no_text
        decode = tokenizer.incremental(config.skip_special_tokens)
        if config.include_stop_str_in_output:
            return decode
        return lambda ids: decode(text_ids(ids, config, self.generator.eos_token_ids))

    def _withdraw(self, handle: RequestHandle) -> None:
        """A request cancelled while it waits leaves the queue now, not when a slot frees (its
        client gone, it must not keep a live one out, nor count as waiting)."""
        with self._wake:
            try:
                self._waiting.remove(handle)
            except ValueError:  # taken into the batch already: it ends at the next round
                return
        handle._finish(_nothing(handle.request, "cancelled"))

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
                row = next(row for row in self._runner.rows if row.request.key == handle.key)
                handle._prompt_logprobs = row.prompt_logprobs  # before its first delta
                new_ids = row.tokens[len(row.request.prompt) :]
                handle._progress(new_ids, logprobs=row.logprobs)

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
        for request, new_ids, logprobs in self._runner.active():
            self._running[request.key]._progress(new_ids, now, logprobs)


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

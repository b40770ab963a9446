"""The per-request API for services: many threads or asyncio tasks share one generator; each
request streams text deltas that concatenate to its final text, can be cancelled (or dropped),
and a full service says it is overloaded."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from specrt.errors import InvalidInputError, OverloadedError, ServiceClosedError, SpecrtError
from specrt.export.tiny import make_tokenizer
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.service import Service
from specrt.runtime.streaming import TextDeltas
from specrt.runtime.tokenizer import IncrementalDecode
from tests.conftest import in_threads
from tests.test_greedy import PROMPTS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serial(llama_bundle):
    """Greedy outputs one prompt at a time, without the service."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    return {p: r for p, r in zip(PROMPTS, generator.generate(PROMPTS, config))}


@pytest.fixture
def service(llama_bundle):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    with Service(generator, max_waiting=32) as running:
        yield running


def test_concurrent_threads_get_their_serial_output(service, serial):
    """16 threads at once (4 slots, the rest wait): every stream's deltas concatenate to its
    text, which is the prompt's greedy output alone."""
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)

    def client(prompt: str):
        handle = service.submit(prompt, config)
        deltas = list(handle)
        return "".join(deltas), len(deltas), handle.result()

    outputs = in_threads(client, PROMPTS[:16])
    assert len(outputs) == 16
    for prompt, (streamed, _count, result) in outputs.items():
        assert streamed == result.text == serial[prompt].text, prompt
        assert result.token_ids == serial[prompt].token_ids
    assert max(count for _, count, _ in outputs.values()) > 2  # text came in several deltas


def test_asyncio_tasks_stream_without_blocking_the_loop(service, serial):
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)

    async def main():
        ticks = 0

        async def ticker():  # runs only if the loop is free while clients wait
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        async def client(prompt):
            handle = service.submit(prompt, config, per_token=True)
            deltas = [delta async for delta in handle]
            return prompt, deltas, await handle.wait()

        tick = asyncio.create_task(ticker())
        started = time.perf_counter()
        results = await asyncio.gather(*(client(p) for p in PROMPTS[:8]))
        tick.cancel()
        return results, ticks, time.perf_counter() - started

    results, ticks, seconds = asyncio.run(main())
    # A blocked loop ticks once; a free one about once a millisecond the clients waited (a
    # tiny model's 8 x 20 tokens can take under 10 ms, so no fixed count)
    assert ticks >= max(3, 0.1 * seconds / 0.001), (ticks, seconds)
    for prompt, deltas, result in results:
        assert "".join(deltas) == result.text == serial[prompt].text


@pytest.mark.parametrize("per_token", [False, True], ids=["per-round", "per-token"])
def test_deltas_bring_each_tokens_logprobs_once_and_in_order(service, serial, per_token):
    """`RequestHandle.deltas`: each token's log-probabilities go out once, in order, with the
    first text after the token came (a stop string holding text back too); joined they are the
    result's. A request that asks for none gets None in every delta."""
    prompt = next(p for p in PROMPTS if len(serial[p].text) >= 12)
    stop = serial[prompt].text[6:9]
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, logprobs=1)
    for asked in (config, replace(config, stop=[stop])):
        handle = service.submit(prompt, asked, per_token=per_token)
        deltas = list(handle.deltas())
        result = handle.result()
        assert "".join(delta.text for delta in deltas) == result.text
        assert [e for delta in deltas for e in delta.logprobs] == result.logprobs
        assert [e.token for e in result.logprobs] == result.token_ids
        assert len(deltas) > 1 and all(delta.logprobs for delta in deltas)
    full = serial[prompt].text
    assert result.finish_reason == "stop" and result.text == full[: full.index(stop)]
    handle = service.submit(prompt, replace(config, logprobs=None), per_token=per_token)
    assert all(delta.logprobs is None for delta in handle.deltas())


def test_cancel_and_dropped_iterators_free_their_slots(service, serial):
    long = GenerationConfig(  # the model drafts: 100 tokens take a while to cancel in
        max_new_tokens=100, num_draft_tokens=3, ignore_eos=True, proposer="model",
        draft_schedule="fixed",
    )  # fmt: skip
    handle = service.submit(PROMPTS[0], long)
    stream = iter(handle)
    next(stream)  # it is running
    handle.cancel()
    result = handle.result(timeout=30)
    assert result.finish_reason == "cancelled" and 0 < len(result.token_ids) < 100
    for _ in range(20):  # consumers that walk away after the first delta
        dropped = service.submit(PROMPTS[1], long)
        for _delta in dropped:
            break
        del _delta
        gc.collect()
        assert dropped.result(timeout=30).finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while service.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.running == 0
    after = service.submit(PROMPTS[2], GenerationConfig(max_new_tokens=20, num_draft_tokens=3))
    assert after.result(timeout=30).text == serial[PROMPTS[2]].text


def test_seeded_requests_beside_greedy_ones(service, serial):
    """Seeded sampled requests share the calls of the others: each gives what it gives alone
    (the target alone's tokens under its seed), the greedy ones beside them give their serial
    output, and cancelling a seeded one in the middle frees its slot for the rest."""
    seeded = GenerationConfig(max_new_tokens=20, temperature=1.0, num_draft_tokens=3, seed=5)
    greedy = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    alone = {p: service.submit(p, seeded).result(timeout=30).token_ids for p in PROMPTS[:4]}
    long = GenerationConfig(
        max_new_tokens=200, temperature=1.0, num_draft_tokens=3, seed=9, ignore_eos=True
    )
    cancelled = service.submit(PROMPTS[5], long)
    release = held(cancelled)  # running until it is cancelled, however fast its tokens come
    admitted(cancelled)

    def client(item: tuple[str, str]):
        prompt, kind = item
        if kind == "cancel":
            cancelled.cancel()
            release.set()
            return cancelled.result(timeout=30)
        return service.submit(prompt, seeded if kind == "seeded" else greedy).result(timeout=60)

    items = [(p, "seeded") for p in PROMPTS[:4]] + [(p, "greedy") for p in PROMPTS[4:12]]
    outputs = in_threads(client, [*items, ("", "cancel")])
    assert outputs[("", "cancel")].finish_reason == "cancelled"
    for (prompt, kind), result in outputs.items():
        if kind == "seeded":
            assert result.token_ids == alone[prompt], prompt
        elif kind == "greedy":
            assert result.token_ids == serial[prompt].token_ids, prompt
    assert service.running == 0


def test_a_round_that_raises_fails_its_requests_instead_of_hanging_them(service, serial):
    """A bug in a round (here an exception the runner raises once) ends the requests in flight
    with an error; the service goes on serving the next ones."""
    step = service._runner.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return step()

    service._runner.step = broken
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    handle = service.submit(PROMPTS[0], config)
    with pytest.raises(SpecrtError, match="internal error in the service: RuntimeError"):
        handle.result(timeout=30)
    assert service.submit(PROMPTS[2], config).result(timeout=30).text == serial[PROMPTS[2]].text


def test_a_service_takes_its_caches_memory_at_start(llama_bundle, monkeypatch):
    """A long-lived service maps the cache memory of its longest rows when it starts (growing
    into new memory held every running request for ~60 ms on the demo pair); the capacity
    rows attend over stays at one step until a row needs more."""
    from specrt.backends import rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=2)
    decoders = (generator.target, generator.draft)
    capacities = [decoder.capacity for decoder in decoders]
    with Service(generator):
        for decoder, capacity in zip(decoders, capacities):
            assert decoder._block_capacity == decoder.max_positions > capacity
            assert decoder.capacity == capacity


def held(handle) -> threading.Event:
    """Hold the service's thread in ``handle``'s next gap between rounds (so it is still
    running however fast its tokens come) until the returned event is set."""
    release, here = threading.Event(), threading.current_thread()

    def hold(gap):
        if threading.current_thread() is not here:
            release.wait(60)

    handle.add_gap_callback(hold)
    return release


def admitted(handle) -> None:
    """Wait until ``handle`` has left the queue for the batch (its first text may be empty, and
    held back with its first round)."""
    deadline = time.monotonic() + 30
    while handle.admitted_at is None:
        assert time.monotonic() < deadline, "never admitted"
        time.sleep(0.001)


def test_a_full_service_is_overloaded(llama_bundle):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=1)
    long = GenerationConfig(max_new_tokens=100, num_draft_tokens=2, ignore_eos=True)
    with Service(generator, max_waiting=1) as service:
        first = service.submit(PROMPTS[0], long)
        # held at its first round: 100 tokens of a tiny model could end before the next submit
        release = held(first)
        admitted(first)  # the batch of one is full
        queued = service.submit(PROMPTS[1], long)
        with pytest.raises(OverloadedError, match="overloaded: 1 requests running and 1 waiting"):
            service.submit(PROMPTS[2], long)
        first.cancel()
        queued.cancel()
        release.set()
        assert queued.result(timeout=30).finish_reason == "cancelled"
    with pytest.raises(ServiceClosedError, match="shutting down or closed: it takes no more"):
        service.submit(PROMPTS[0], long)
    with Service(generator, max_waiting=0) as service:  # no queue: only a free slot takes one
        first = service.submit(PROMPTS[0], long)
        release = held(first)
        admitted(first)
        with pytest.raises(OverloadedError, match="overloaded: 1 requests running and 0 waiting"):
            service.submit(PROMPTS[1], long)
        first.cancel()
        release.set()
        assert first.result(timeout=30).finish_reason == "cancelled"
        again = service.submit(PROMPTS[1], GenerationConfig(max_new_tokens=4))
        assert again.result(timeout=30).finish_reason == "length"


def test_a_priority_service_takes_the_lowest_priority_first_and_fcfs_only_0(llama_bundle):
    """vLLM's priority scheduling: a free slot goes to the waiting request of the lowest
    ``priority``, the first of equals; a first-come service refuses any other than 0, so a
    client's priority is never silently ignored."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=1)
    long = GenerationConfig(max_new_tokens=100, num_draft_tokens=2, ignore_eos=True)
    short = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    with Service(generator, max_waiting=4, scheduling_policy="priority") as service:
        first = service.submit(PROMPTS[0], long)
        release = held(first)  # the one slot stays taken while the others queue
        try:
            admitted(first)
            priorities = [5, -1, 5, 0]
            queued = [
                service.submit(PROMPTS[i], short, priority=p) for i, p in enumerate(priorities)
            ]
            assert service.waiting == 4
        finally:
            first.cancel()
            release.set()
        results = [handle.result(timeout=30) for handle in queued]
        order = sorted(range(4), key=lambda i: queued[i].admitted_at)
        assert order == [1, 3, 0, 2]  # -1, 0, then the two of 5 as they came
        with pytest.raises(InvalidInputError, match="priority='high' is a string, not an"):
            service.submit(PROMPTS[0], short, priority="high")
    alone = generator.generate(PROMPTS[:4], short)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    with Service(generator) as service:  # first come, first served: vLLM's default
        assert service.submit(PROMPTS[0], short, priority=0).result(timeout=30).token_ids
        with pytest.raises(
            InvalidInputError, match=r"priority=2: this service takes requests first come, first "
        ):
            service.submit(PROMPTS[0], short, priority=2)
    with pytest.raises(InvalidInputError, match="scheduling_policy='lifo': use 'fcfs'"):
        Service(generator, scheduling_policy="lifo")


def test_a_request_cancelled_while_it_waits_leaves_the_queue_at_once(llama_bundle):
    """A server's client that hangs up while its request waits must not keep its place until
    a slot frees: three such made a live client's request overloaded, and were counted as
    waiting."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=1)
    long = GenerationConfig(max_new_tokens=100, num_draft_tokens=2, ignore_eos=True)
    with Service(generator, max_waiting=2) as service:
        first = service.submit(PROMPTS[0], long)
        release = held(first)  # the one slot stays taken until released
        try:
            admitted(first)
            gone = [service.submit(PROMPTS[1], long), service.submit(PROMPTS[2], long)]
            ended = []
            gone[0].add_done_callback(ended.append)
            with pytest.raises(OverloadedError, match="1 requests running and 2 waiting"):
                service.submit(PROMPTS[3], long)
            for handle in gone:
                handle.cancel()
            # ended now, the slot still taken: not at the next round, nor once a slot frees
            assert ended == [gone[0]] and service.waiting == 0 and not first.done
            assert [h.result(timeout=0).finish_reason for h in gone] == ["cancelled"] * 2
            assert gone[1].result(timeout=0).token_ids == []
            live = service.submit(PROMPTS[3], GenerationConfig(max_new_tokens=4))
            assert service.waiting == 1
        finally:
            first.cancel()
            release.set()
        assert live.result(timeout=30).finish_reason == "length"
        assert first.result(timeout=30).finish_reason == "cancelled"


def test_a_done_callback_that_calls_the_generator_is_refused_not_deadlocked(llama_bundle):
    """The service thread runs done callbacks holding the generator's lock: one that called
    ``generate`` waited for it forever, and the service with it."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=2)
    service = Service(generator)  # no `with`: a hung service could not be closed
    refused = []

    def callback(handle) -> None:
        try:
            generator.generate(["x"], GenerationConfig(max_new_tokens=2))
        except InvalidInputError as exc:
            refused.append(str(exc))

    first = service.submit(PROMPTS[0], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    release = held(first)  # the callback is added before the request can end
    first.add_done_callback(callback)
    release.set()
    assert first.result(timeout=30).finish_reason == "length"
    later = service.submit(PROMPTS[1], GenerationConfig(max_new_tokens=4))
    assert later.result(timeout=30).finish_reason == "length"  # the service goes on
    assert refused and "this generator runs a Service" in refused[0]
    with pytest.raises(InvalidInputError, match="callback must be callable, not int"):
        later.add_done_callback(5)  # it failed later, on the service's thread
    with pytest.raises(InvalidInputError, match="callback must be callable"):
        later.add_gap_callback(None)
    for wait in (later.result, service.close):  # TypeError from inside threading
        with pytest.raises(InvalidInputError, match="timeout='a' is a string, not a number"):
            wait(timeout="a")
    service.close()


def test_stop_strings_never_leak_into_the_stream(service, serial):
    for prompt in PROMPTS[:10]:
        full = serial[prompt].text
        if len(full) < 10:
            continue
        stop = full[5:8]
        config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, stop=[stop])
        handle = service.submit(prompt, config, per_token=True)
        deltas = list(handle)
        assert "".join(deltas) == full[: full.find(stop)] == handle.result().text
        assert handle.result().finish_reason == "stop"


def test_max_new_tokens_is_exact_when_a_round_overshoots(service):
    for limit in (1, 2, 5, 7):
        config = GenerationConfig(max_new_tokens=limit, num_draft_tokens=4, ignore_eos=True)
        assert len(service.submit(PROMPTS[3], config).result(timeout=30).token_ids) == limit


def test_deltas_hold_back_half_characters_and_stop_prefixes():
    """UTF-8 safe: a character split over tokens is sent whole, once; a tail that may begin a
    stop string waits; the pieces concatenate to the final text."""
    tokens = ["é".encode()[:1], "é".encode()[1:], b" a", b"b", b"\n", b"x"]

    def decode(ids):
        return b"".join(tokens[i] for i in ids).decode("utf-8", errors="replace")

    deltas = TextDeltas(decode, stops=["\n\n"])
    pieces = [deltas.update(list(range(n))) for n in range(1, 7)]
    assert pieces == ["", "é", " a", "b", "", "\nx"]
    assert deltas.finish(decode(list(range(6)))) == ""
    assert "".join(pieces) == decode(list(range(6)))


@pytest.mark.parametrize("kind", ["byte-level BPE (demo)", "metaspace (tiny models)"])
def test_incremental_decode_is_the_full_decode(kind):
    """Rounds of 1-6 tokens (text with multi-byte characters, bytes that split them, special
    tokens, ids past the vocabulary): after each round the incremental text is the full decode
    of every id so far, less an incomplete character at the end (U+FFFD in the full decode);
    a prefix is answered from it and a list that does not continue the last one starts over."""
    if kind.startswith("byte"):
        tokenizer = Tokenizer.from_file(str(REPO / "models/demo/tokenizer/tokenizer.json"))
    else:
        tokenizer = make_tokenizer()._tokenizer

    def full(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    def same(text, ids):
        rest = full(ids)
        return rest.startswith(text) and set(rest[len(text) :]) <= {"\ufffd"}

    text = "naïve café — 日本語 😀 ✓\ndef f(x):\n    return x  # ok"
    vocab = tokenizer.get_vocab_size()
    rng = np.random.default_rng(0)
    for trial in range(40):
        ids = tokenizer.encode(text).ids
        noise = rng.integers(0, [vocab, 300, vocab + 8][trial % 3], size=rng.integers(0, 30))
        ids = [*ids[: rng.integers(len(ids) + 1)], *noise.tolist(), *ids]
        decode, count = IncrementalDecode(tokenizer), 0
        while count < len(ids):
            count = min(len(ids), count + int(rng.integers(1, 7)))
            assert same(decode(ids[:count]), ids[:count]), (trial, count)
            cut = int(rng.integers(count + 1))
            assert same(decode(ids[:cut]), ids[:cut])  # a prefix: from the text so far
        assert same(decode(ids[1:]), ids[1:])  # not a continuation: starts over
        assert same(decode(ids), ids)
    assert decode([]) == ""


def test_the_first_token_comes_at_admission(service, serial, llama_bundle):
    """A request's first token is the target's own, handed out right after its prefill: with
    max_new_tokens=1 (or a stop string in that token) the request ends at admission, with the
    target alone's token, on the service, the batched runner and the one-row loop alike."""
    tokenizer = service.generator.tokenizer
    prompts = PROMPTS[:6]
    first = {p: serial[p].token_ids[0] for p in prompts}
    config = GenerationConfig(max_new_tokens=1, num_draft_tokens=3)
    handles = {p: service.submit(p, config) for p in prompts}
    for prompt, handle in handles.items():
        streamed = "".join(handle)
        result = handle.result()
        assert result.token_ids == [first[prompt]] and result.finish_reason == "length"
        assert streamed == result.text == tokenizer.decode([first[prompt]])
        assert result.stats.rounds == 1 and result.stats.drafted_tokens == 0
    batched = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    one_row = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    for generator in (batched, one_row):
        results = generator.generate(prompts, config)
        assert [r.token_ids for r in results] == [[first[p]] for p in prompts]
    prompt = next(p for p in prompts if tokenizer.decode([first[p]]).strip())
    stop = tokenizer.decode([first[prompt]]).strip()
    handle = service.submit(prompt, GenerationConfig(max_new_tokens=20, stop=[stop]))
    assert "".join(handle) == "" and handle.result().finish_reason == "stop"


def test_inter_token_gaps_are_handed_out_as_they_come(service):
    """A request's gaps between rounds that gave it tokens reach a gap callback while it runs
    (what the server's inter-token histograms observe, as vLLM's do), each once: the ones
    before the callback was added at once, the rest from the service's thread as they come."""
    config = GenerationConfig(max_new_tokens=60, num_draft_tokens=0, ignore_eos=True)
    handle = service.submit(PROMPTS[0], config)
    seen: list[tuple[float, bool]] = []
    handle.add_gap_callback(lambda gap: seen.append((gap, handle.done)))
    result = handle.result()
    assert len(result.token_ids) == 60
    gaps = sorted(gap for gap, _ in seen)  # those passed at once may follow a newer one
    assert gaps == sorted(handle.token_gaps) and len(gaps) == result.stats.rounds - 1
    assert sum(not done for _, done in seen) > len(seen) // 2  # not at the request's end
    assert sum(gaps) == pytest.approx(handle.last_token_at - handle.first_token_at)
    late: list[float] = []
    handle.add_gap_callback(late.append)  # after the end: all of them at once
    assert late == handle.token_gaps


def test_a_request_that_comes_during_an_admission_does_not_wait_a_round(llama_bundle, serial):
    """Requests arriving while others are prefilled are admitted before the batch's next round
    (else they would wait for the admission and then a whole round): here B is submitted from
    within A's admission, and is admitted before any round runs; both are their serial
    outputs."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    events, later = [], []
    with Service(generator) as service:
        runner = service._runner
        add, step = runner.add, runner.step

        def admitting(requests):
            events.append(("admit", [r.key for r in requests]))
            if not later:  # B arrives while A is being prefilled
                later.append(service.submit(PROMPTS[1], config))
            return add(requests)

        def stepping():
            events.append(("round", None))
            return step()

        runner.add, runner.step = admitting, stepping
        first = service.submit(PROMPTS[0], config)
        results = [first.result(timeout=60), later[0].result(timeout=60)]
    assert events[:3] == [("admit", [first.key]), ("admit", [later[0].key]), ("round", None)]
    assert [r.token_ids for r in results] == [serial[p].token_ids for p in PROMPTS[:2]]


def test_requests_admitted_together_each_get_their_first_token_after_their_own_prefill(
    llama_bundle, serial
):
    """Requests that come back together are prefilled one by one, the shortest prompt first,
    and each one's first token is handed out before the next prompt is prefilled; every
    output is still its serial one."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    prompts = sorted(PROMPTS[2:5], key=len, reverse=True)  # submitted longest first
    added, handles = [], {}
    with Service(generator) as service:
        runner = service._runner
        add = runner.add

        def adding(requests):
            started = [key for key, h in handles.items() if h._sent_tokens]
            added.append(([r.key for r in requests], started))
            return add(requests)

        runner.add = adding
        with service._wake:  # all three wait, then are admitted at once
            for prompt in prompts:
                handle = service.submit(prompt, config)
                handles[handle.key] = handle
        results = [handle.result(timeout=60) for handle in handles.values()]
    by_length = sorted(handles, key=lambda key: len(handles[key].request.prompt))
    assert [keys for keys, _ in added] == [[key] for key in by_length]
    assert [sorted(started) for _, started in added] == [sorted(by_length[:n]) for n in range(3)]
    assert [r.token_ids for r in results] == [serial[p].token_ids for p in prompts]


def test_the_caches_are_the_services_while_it_runs_requests(llama_bundle, serial):
    """A Service owns its generator's caches: a second Service on it is refused, and so is a
    direct call while it runs (either would overwrite its requests' rows between two rounds;
    the outputs stay the serial ones); once the service is closed the generator is free."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    long = GenerationConfig(max_new_tokens=100, num_draft_tokens=3, ignore_eos=True)
    with Service(generator) as service:
        with pytest.raises(InvalidInputError, match="already runs a Service"):
            Service(generator)
        running = service.submit(PROMPTS[0], long)
        deltas = iter(running)  # kept: a dropped iterator cancels its request
        next(deltas)  # admitted: its rows are in the caches
        with pytest.raises(InvalidInputError, match="this generator runs a Service"):
            generator.generate([PROMPTS[1]], config)
        handle = service.submit(PROMPTS[1], config)
        assert handle.result(timeout=60).token_ids == serial[PROMPTS[1]].token_ids
        running.cancel()
        running.result(timeout=60)
    assert generator.generate([PROMPTS[2]], config)[0].token_ids == serial[PROMPTS[2]].token_ids
    with Service(generator) as again:  # a closed service hands the caches back
        assert again.submit(PROMPTS[3], config).result(timeout=60).token_ids == (
            serial[PROMPTS[3]].token_ids
        )


def test_close_from_a_done_callback_hands_the_generator_back(llama_bundle, serial):
    """Done callbacks run on the service's thread: close() there failed ("cannot join current
    thread") and left the service half closed, its generator refused to every later call."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    service = Service(generator)
    closed = threading.Event()

    def close(handle):
        service.close()
        closed.set()

    first = service.submit(PROMPTS[0], config)
    second = service.submit(PROMPTS[1], config)  # running when the first one's callback closes
    first.add_done_callback(close)
    assert closed.wait(60) and second.result(timeout=60).token_ids == serial[PROMPTS[1]].token_ids
    deadline = time.monotonic() + 60
    while service._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert generator.generate([PROMPTS[2]], config)[0].token_ids == serial[PROMPTS[2]].token_ids
    with pytest.raises(OverloadedError, match="shutting down"):
        service.submit(PROMPTS[3], config)


def test_a_service_dropped_without_close_lets_go_of_its_generator(llama_bundle, serial):
    """Its thread held it for good (the generator refused every later call, a thread leaked
    per service); now the thread holds it only while it works."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    service = Service(generator)
    assert service.submit(PROMPTS[0], config).result(timeout=60).text == serial[PROMPTS[0]].text
    thread = service._thread
    del service
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert generator.generate([PROMPTS[1]], config)[0].token_ids == serial[PROMPTS[1]].token_ids


def test_a_stream_left_open_is_named_not_waited_for(llama_bundle, serial):
    """A partly read batched stream holds its rows: a call from the same thread could only
    wait for itself (it hung); it is refused, as is a Service on that generator, and both
    work once the stream is closed."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    stream = generator.stream(PROMPTS[:3], config)
    assert next(stream).token_ids == serial[PROMPTS[0]].token_ids
    with pytest.raises(InvalidInputError, match="still open in this thread"):
        generator.generate([PROMPTS[4]], config)
    with pytest.raises(InvalidInputError, match="not read to the end"):
        Service(generator)
    stream.close()
    assert generator.generate([PROMPTS[4]], config)[0].token_ids == serial[PROMPTS[4]].token_ids
    with Service(generator) as service:
        assert service.submit(PROMPTS[5], config).result(timeout=60).text == serial[PROMPTS[5]].text


def test_a_consumer_whose_event_loop_closed_costs_only_its_own_request(llama_bundle, serial):
    """An asyncio consumer that gives up (its task cancelled, then its loop closed) leaves a
    waiter behind; waking it must not fail the service's other requests."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=20, num_draft_tokens=3)
    long = GenerationConfig(max_new_tokens=100, num_draft_tokens=3, ignore_eos=True)
    with Service(generator) as service:
        other = service.submit(PROMPTS[0], config)
        abandoned = service.submit(PROMPTS[1], long)
        release = held(abandoned)  # so the abandoned request is still running

        async def consume():
            async for _ in abandoned:
                pass

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(asyncio.wait_for(consume(), 0.01))
        release.set()
        assert other.result(timeout=60).token_ids == serial[PROMPTS[0]].token_ids
        assert abandoned.result(timeout=60).finish_reason in ("cancelled", "length")
        later = service.submit(PROMPTS[2], config)
        assert later.result(timeout=60).token_ids == serial[PROMPTS[2]].token_ids


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda g: Service(None), "a Service runs a SpeculativeGenerator, not NoneType"),
        (lambda g: Service(g, max_waiting=-1), "max_waiting=-1"),
        (lambda g: Service(g, max_waiting="8"), "max_waiting='8'"),
        (lambda g: Service(g).submit("Simple", {}), "config must be a GenerationConfig"),
        (lambda g: Service(g).submit(["a", "b"]), "submit takes one prompt"),
        (lambda g: Service(g).submit("a", per_token=1), "per_token=1 is"),
        (
            lambda g: Service(SpeculativeGenerator.from_bundle(g.bundle, engine="portable")),
            r"load it with max_batch >= 2 \(specrt serve --batch-size 2 or more\)",
        ),
    ],
)
def test_a_service_of_the_wrong_things_is_refused_up_front(llama_bundle, make, message):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=2)
    generator.bundle = llama_bundle
    with pytest.raises(InvalidInputError, match=message):
        make(generator)


def test_truncate_prompt_tokens_reads_a_prompts_last_tokens(llama_bundle):
    """vLLM's ``truncate_prompt_tokens``: a prompt too long for the context is read from its last
    N tokens (-1: as many as leave room for one new token), exactly as if they were the whole
    prompt, through `generate`, `run` and a `Service`; a shorter prompt is read whole."""
    from specrt.errors import PromptTooLongError
    from specrt.runtime.batching import Request

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    limit = generator.target.max_positions
    ids = [3 + (7 * i) % 40 for i in range(limit + 20)]  # longer than the context
    base = GenerationConfig(max_new_tokens=6, num_draft_tokens=3)
    with pytest.raises(PromptTooLongError):
        generator.generate([ids], base)
    for keep, read in ((40, 40), (-1, limit - 1)):
        config = replace(base, truncate_prompt_tokens=keep)
        [expected] = generator.generate([ids[-read:]], base)
        [cut] = generator.generate([ids], config)
        assert cut.token_ids == expected.token_ids and cut.stats.prompt_tokens == read
        [(_, ran)] = generator.run([Request("r", ids, config)])
        assert ran.token_ids == expected.token_ids
        with Service(generator) as service:
            assert service.submit(ids, config).result().token_ids == expected.token_ids
    [whole] = generator.generate([ids[:30]], replace(base, truncate_prompt_tokens=40))
    assert whole.stats.prompt_tokens == 30
    for bad in (0, -2, True, 2.5, "8"):
        with pytest.raises(InvalidInputError, match="truncate_prompt_tokens"):
            GenerationConfig(truncate_prompt_tokens=bad)

"""Prometheus metrics, named and labelled as vLLM's speculative-decoding, scheduler and latency
metrics (every series carries ``model_name``, which vLLM's dashboards filter on), so existing
dashboards read them."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from specrt.runtime.handles import RequestHandle
from specrt.runtime.service import Service

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
# A gap between rounds may hold a round of many tokens and other requests' prompts: up to
# vLLM's 80 s
GAP_BUCKETS = (*TOKEN_TIME_BUCKETS, 2.5, 5, 10, 20, 40, 80)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
FINISHED_REASONS = {"cancelled": "abort"}


class _ForModel:
    """A labelled metric's children for one model: ``labels(*others)``."""

    def __init__(self, metric, model_name: str) -> None:
        self.metric, self.model_name = metric, model_name

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)


class Metrics:
    """One registry per server: the scheduler's state (requests running and waiting, the KV
    cache held; read at each scrape), counters of requests, tokens and speculation, and
    histograms of each request's latency, time to first token, time in the queue, time per
    output token and token counts."""

    def __init__(self, service: Service, model_name: str) -> None:
        # No `*_created` series beside every counter and histogram (as vLLM): they double what
        # a scrape stores and no dashboard reads them. Process-wide, as the server is.
        disable_created_metrics()
        self.registry = registry = CollectorRegistry()

        def counter(name: str, documentation: str, *labels: str):
            """A counter of this model's (the child for its name, where no other label)."""
            metric = Counter(name, documentation, ["model_name", *labels], registry=registry)
            return metric.labels(model_name) if not labels else _ForModel(metric, model_name)

        def gauge(name: str, documentation: str, read) -> None:
            metric = Gauge(name, documentation, ["model_name"], registry=registry)
            metric.labels(model_name).set_function(read)

        def histogram(name: str, documentation: str, buckets: tuple):
            labels = ["model_name"]
            metric = Histogram(name, documentation, labels, buckets=buckets, registry=registry)
            return metric.labels(model_name)

        gauge("vllm:num_requests_running", "Requests in the batch", lambda: service.running)
        gauge("vllm:num_requests_waiting", "Requests waiting for a slot", lambda: service.waiting)
        # vLLM's name, and the older one its Grafana dashboard's cache panel reads
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage = "Share of the KV cache positions the running requests hold (1: all)"
            gauge(name, usage, lambda: service.cache_usage)
        self.requests = counter("vllm:request_success", "Finished requests", "finished_reason")
        # vLLM's (its HTTP instrumentator's): every answer by route and status class, so the
        # refused (400, 429) show beside the finished
        self.http_requests = counter(
            "http_requests", "HTTP answers by route, method and status", "handler", "method",
            "status",
        )  # fmt: skip
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens")
        # vLLM's prefix caching counters, in tokens: the prompts', those copied, not read
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.drafts = counter(
            "vllm:spec_decode_num_drafts", "Verification passes that checked drafts"
        )
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.accepted_per_position = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            "position",
        )
        # Ours (vLLM has one proposer per server): the same counts split by proposer.
        self.proposer_drafts = counter(
            "specrt:proposer_num_drafts",
            "Verification passes that checked drafts, by proposer",
            "proposer",
        )
        self.proposer_draft_tokens = counter(
            "specrt:proposer_num_draft_tokens",
            "Draft tokens proposed, by proposer (model, lookup, suffix, corpus, grammar)",
            "proposer",
        )
        self.proposer_accepted_tokens = counter(
            "specrt:proposer_num_accepted_tokens", "Draft tokens accepted, by proposer", "proposer"
        )
        self.proposer_accepted_per_position = counter(
            "specrt:proposer_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by proposer and position in the draft",
            "proposer",
            "position",
        )

        self.latency = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS
        )
        self.first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited for a slot", LATENCY_BUCKETS
        )
        self.time_per_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
            TOKEN_TIME_BUCKETS,
        )
        # vLLM's inter-token latency, under its current name and the one its Grafana dashboard
        # reads: the time between the rounds that gave a request tokens (a round may give many)
        self.inter_token = [
            histogram(name, "Time between the rounds that gave a request tokens", GAP_BUCKETS)
            for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
        ]
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From leaving the queue to the request's first token",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "From the request's first token to its last",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "From leaving the queue to the request's last token",
            LATENCY_BUCKETS,
        )
        self.max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens a request asked for",
            TOKEN_COUNT_BUCKETS,
        )  # fmt: skip
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Tokens a request generated (one sequence a request: as request_generation_tokens)",
            TOKEN_COUNT_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Tokens a request generated", TOKEN_COUNT_BUCKETS
        )

    def inter_token_gap(self, seconds: float) -> None:
        """Observe a gap between two rounds that gave a request tokens (a gap callback of its
        handle: as vLLM does, each as it happens, not when the request ends)."""
        for metric in self.inter_token:
            metric.observe(seconds)

    def record(self, handle: RequestHandle) -> None:
        """Count a request that ended (a done callback of its handle)."""
        result = handle._result
        if result is None:  # failed: no tokens to count
            self.requests.labels("error").inc()
            return
        stats = result.stats
        # vLLM's names for why a request ended ("abort": cancelled, or its client went away)
        self.requests.labels(FINISHED_REASONS.get(result.finish_reason, result.finish_reason)).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_queries.inc(stats.prompt_tokens)
        self.prefix_hits.inc(stats.cached_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.drafts.inc(stats.draft_rounds)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(str(position)).inc(count)
        for source, entry in stats.proposers.items():
            self.proposer_drafts.labels(source).inc(entry["rounds"])
            self.proposer_draft_tokens.labels(source).inc(entry["proposed"])
            self.proposer_accepted_tokens.labels(source).inc(entry["accepted"])
            for position, count in enumerate(entry["accepted_per_position"]):
                self.proposer_accepted_per_position.labels(source, str(position)).inc(count)
        now, tokens = time.perf_counter(), len(result.token_ids)
        first = handle.first_text_at or now
        self.latency.observe(now - handle.submitted_at)
        self.first_token.observe(first - handle.submitted_at)
        if handle.admitted_at is not None:
            self.queue_time.observe(handle.admitted_at - handle.submitted_at)
        if tokens > 1:
            self.time_per_token.observe((now - first) / (tokens - 1))
        self.request_prompt_tokens.observe(stats.prompt_tokens)
        self.request_generation_tokens.observe(tokens)
        self.max_generation_tokens.observe(tokens)
        self.max_tokens.observe(handle.request.config.max_new_tokens)
        started, first, last = handle.admitted_at, handle.first_token_at, handle.last_token_at
        if started is not None and first is not None:
            self.prefill_time.observe(first - started)
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - started)

    def answered(self, handler: str, method: str, status: int) -> None:
        """Count an HTTP answer: ``handler``, the route's path ("none" where no route serves
        it, so that the label's values stay bounded)."""
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

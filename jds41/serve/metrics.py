"""`GET /metrics`: Prometheus text under vLLM's metric names with the `jds41:` prefix (SERVING.md §Metrics).

Counters are kept here by the HTTP layer, one `RequestTrace` per request, because it alone sees every request end
the way the client saw it: a stop string ends a request as `stop` even though the scheduler was told to cancel,
and a client that disconnects is an `abort`; the end-to-end latency histogram is observed here for the same reason.
The other latency histograms take the scheduler's own observations (submit to first sample, between samples, time
in the queue), drained at each scrape; gauges are read live from the scheduler. Each app has its own registry: two
servers in one process never share counts.

Prefix cache (issue #10): `prefix_cache_queries` counts prompt tokens looked up (vLLM's meaning); unlike vLLM,
`prefix_cache_hits` / `_misses` count requests and `prefix_cache_hit_tokens` the tokens restored; `_evictions`
and the `prefix_cache_bytes` gauge follow the byte budget. All 0 while the cache is off (--prefix-cache-bytes 0).

Tiers (`--profile` other than all-hbm): expert lookups and hits per tier, SSD bytes read, prefetch guesses, from
the engine's tier runtime; Engram rows read on the host in every placement. The
speculative-decoding counters come from the scheduler's drafted lane (0 without --draft). The router lean's swaps,
back-offs, margin and top-k agreement come from the engine's live guard (zeros while the lean is off, as it is
under the all-hbm placement).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
P = "jds41:"
FINISH_REASONS = ("stop", "length", "abort")
TIERS = ("hbm", "host", "ssd")

BUCKETS = {
    "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
    "inter_token_latency_seconds": (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                    1.0, 2.5, 5.0, 10.0),
    "e2e_request_latency_seconds": (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                                    1920.0),
    "request_queue_time_seconds": (0.001, 0.01, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 480.0),
}
HELP = {
    "time_to_first_token_seconds": "Time from request arrival to its first generated token.",
    "inter_token_latency_seconds": "Time between consecutive tokens of a request.",
    "e2e_request_latency_seconds": "Time from request arrival to its end.",
    "request_queue_time_seconds": "Time a request waited for a slot.",
}


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, model: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            cumulative.append((bound, total))
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model], buckets=cumulative, sum_value=self.sum)
        return fam


class ServerMetrics:
    """Everything /metrics reports. All updates happen on the event loop thread."""

    def __init__(self, model_name: str, loader):
        self.model_name, self.loader = model_name, loader
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.hist = {name: Histogram(b) for name, b in BUCKETS.items()}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def trace(self, n_prompt: int) -> RequestTrace:
        return RequestTrace(self, n_prompt)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- prometheus_client collector protocol -----------------------------------------------------------------
    def take_observations(self, stats) -> None:
        """Move the scheduler's raw latency observations into the histograms (the scheduler keeps a bounded
        backlog, so an unscraped server does not grow)."""
        obs = stats.drain_observations()
        # e2e_s is dropped: the scheduler leaves out requests it was told to cancel, stop strings included.
        for key, name in (("ttft_s", "time_to_first_token_seconds"), ("itl_s", "inter_token_latency_seconds"),
                          ("queue_s", "request_queue_time_seconds")):
            for value in obs[key]:
                self.hist[name].observe(value)

    def collect(self):
        m = [self.model_name]
        stats = getattr(self.loader.scheduler, "stats", None)
        if stats is not None and self.loader.ready:
            self.take_observations(stats)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            return fam

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            return fam

        yield gauge("num_requests_running", "Requests in a slot.", getattr(stats, "running", 0))
        yield gauge("num_requests_waiting", "Requests queued for a slot.", getattr(stats, "waiting", 0))
        yield gauge("kv_cache_usage_perc", "KV cache in use (0..1): each slot reserves a whole context.",
                    getattr(stats, "kv_cache_usage_perc", 0.0))
        yield gauge("model_load_progress", "Model load progress (0..1; 1 = ready).", self.loader.fraction)
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", self.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated for finished requests.", self.generation_tokens)
        fam = CounterMetricFamily(P + "request_success", "Finished requests by finish reason.",
                                  labels=["model_name", "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(self.finished)):
            fam.add_metric([*m, reason], self.finished[reason])
        yield fam
        for name, h in self.hist.items():
            yield h.family(P + name, HELP[name], self.model_name)
        yield from self._prefix_cache()
        yield from self._router_lean()
        # speculative lane (serve --draft): 0 without a drafter
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", getattr(stats, "draft_tokens_total", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      getattr(stats, "draft_accepted_total", 0))
        yield from self._tiers()


    def _prefix_cache(self):
        """Prefix cache counters (jds41/prefix_cache.py); zeros when the cache is off or the model not loaded."""
        engine = self.loader.engine
        cache = getattr(engine, "prefix_cache", None)
        st = cache.stats if cache is not None else None
        m = [self.model_name]
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's meaning).",
                 st and st.query_tokens),
                ("prefix_cache_hits", "Requests that resumed from a cached prefix.", st and st.hits),
                ("prefix_cache_misses", "Requests that found no cached prefix.", st and st.misses),
                ("prefix_cache_hit_tokens", "Prompt tokens restored from the prefix cache.", st and st.hit_tokens),
                ("prefix_cache_evictions", "Snapshots evicted for the byte budget.", st and st.evictions)):
            fam = CounterMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value or 0)
            yield fam
        fam = GaugeMetricFamily(P + "prefix_cache_bytes", "Host memory held by prefix snapshots.",
                                labels=["model_name"])
        fam.add_metric(m, cache.nbytes if cache is not None else 0)
        yield fam


    def _tiers(self):
        """Expert traffic by tier (jds41/tiers/runtime.py counts every routed selection of a tiered engine; the
        SSD tier's slot cache its hits and the bytes its misses read), the look-ahead's guesses, and the Engram
        rows read on the host. A resident engine (the all-hbm default) traces no routing: its tier counters stay 0.
        Counted since the engine opened, so the warm-up's compile run (33 prompt and 16 decode tokens) is in them."""
        engine = self.loader.engine
        tiers = getattr(engine, "tiers", None)
        ssd = tiers.stores.ssd.stats if tiers is not None and tiers.stores.ssd is not None else None
        engram = getattr(engine, "engram", None)
        m = [self.model_name]
        for name, doc, value in (
                ("ssd_read_bytes", "Bytes read from the SSD tier (routed experts).", ssd.bytes if ssd else 0),
                ("engram_rows_read", "Engram rows read on the host.", getattr(engram[1], "rows_read", 0) if engram
                 else 0),
                ("prefetch_predictions", "Expert prefetch predictions.", tiers.predictions if tiers else 0),
                ("prefetch_correct", "Expert prefetch predictions that were used.",
                 tiers.predictions_correct if tiers else 0)):
            fam = CounterMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            yield fam
        lookups = [int(n) for n in tiers.lookups] if tiers is not None else [0] * len(TIERS)
        hits = lookups[:2] + [ssd.hits if ssd else 0]  # HBM and host always hit: residency is their definition
        for name, doc, values in (("expert_lookups", "Routed expert lookups by tier.", lookups),
                                  ("expert_hits", "Routed expert lookups served from the tier.", hits)):
            fam = CounterMetricFamily(P + name, doc, labels=["model_name", "tier"])
            for tier, value in zip(TIERS, values):
                fam.add_metric([*m, tier], value)
            yield fam

    def _router_lean(self):
        """The router lean and its live guard (jds41/tiers/lean_guard.py): swaps and back-offs as counters, the
        current margin and the measured top-k agreement as gauges; zeros while the lean is off."""
        engine = self.loader.engine
        tiers = getattr(engine, "tiers", None)
        guard = tiers.guard if tiers is not None else None
        st = guard.stats() if guard is not None else {}
        m = [self.model_name]
        for name, doc, value in (
                ("router_lean_swaps", "Experts the router lean took instead of an unbiased top-k choice.",
                 tiers.lean_swaps if tiers is not None else 0),
                ("router_lean_backoffs", "Times the live guard lowered the lean margin.", st.get("backoffs", 0))):
            fam = CounterMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            yield fam
        for name, doc, value in (
                ("router_lean_margin", "The router lean margin in use (0 = unbiased routing).", st.get("margin", 0.0)),
                ("router_lean_topk_agreement", "Share of routed selections equal to the unbiased top-k.",
                 st.get("topk_agreement") if st.get("topk_agreement") is not None else 1.0)):
            fam = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            fam.add_metric(m, value)
            yield fam


class RequestTrace:
    """One request as the client saw it; `finish` books it exactly once, whichever way the request ends."""

    def __init__(self, metrics: ServerMetrics, n_prompt: int):
        self.metrics, self.n_prompt = metrics, n_prompt
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.n_tokens = 0
        self.done = False

    def token(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.n_tokens += 1

    def finish(self, reason: str, completion_tokens: int | None = None, queue_s: float | None = None,
               drafts: tuple[int, int] = (0, 0)) -> dict:
        """Book the request (`completion_tokens` from the scheduler when known: it counts the stop token, which
        is never sent as text); returns its timings (llama.cpp's `timings` object plus the queue time)."""
        n = self.n_tokens if completion_tokens is None else completion_tokens
        now = time.perf_counter()
        timings = self.timings(now, n, queue_s, drafts)
        if not self.done:
            self.done = True
            m = self.metrics
            m.hist["e2e_request_latency_seconds"].observe(now - self.t0)
            m.prompt_tokens += self.n_prompt
            m.generation_tokens += n
            m.finished[reason] += 1
        return timings

    def timings(self, now: float, n: int, queue_s: float | None, drafts: tuple[int, int] = (0, 0)) -> dict:
        first = self.t_first if self.t_first is not None else now
        prompt_s = max(first - self.t0 - (queue_s or 0.0), 1e-9)
        decode_s = max(now - first, 1e-9)
        n_decode = max(n - 1, 0)  # the first token comes out of the prompt pass
        return {"queue_ms": round((queue_s or 0.0) * 1e3, 3),
                "prompt_n": self.n_prompt, "prompt_ms": round(prompt_s * 1e3, 3),
                "prompt_per_second": round(self.n_prompt / prompt_s, 3),
                "predicted_n": n, "predicted_ms": round(decode_s * 1e3, 3),
                "predicted_per_second": round(n_decode / decode_s, 3) if n_decode else 0.0,
                "draft_n": drafts[0], "draft_n_accepted": drafts[1]}

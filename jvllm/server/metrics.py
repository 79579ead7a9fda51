"""Prometheus metrics of one server, in the app's OWN CollectorRegistry (never the process-global
one, so several apps in one process, e.g. tests, do not collide).

Names follow vLLM's with the `jvllm:` prefix:
  gauges    jvllm:num_requests_running, jvllm:num_requests_waiting, jvllm:num_requests_admitted,
            jvllm:kv_cache_usage_perc (0..1), jvllm:kv_cache_free_blocks, jvllm:kv_cache_total_blocks,
            jvllm:prefix_cache_hit_rate (0..1), jvllm:compiles_after_warmup, jvllm:engine_alive,
            jvllm:warmup_pending
  counters  jvllm:prompt_tokens_total, jvllm:generation_tokens_total, jvllm:num_preemptions_total,
            jvllm:prefix_cache_queries_total, jvllm:prefix_cache_hits_total (prompt tokens looked up /
            found in the prefix cache, counted once per request when its first output arrives),
            jvllm:request_success_total{finished_reason}, jvllm:request_rejected_total{reason}
  speculative decoding (engines with a speculative_config only):
  counters  jvllm:spec_decode_num_drafts_total, jvllm:spec_decode_num_draft_tokens_total,
            jvllm:spec_decode_num_accepted_tokens_total,
            jvllm:spec_decode_num_accepted_tokens_per_pos_total{position}
  gauges    jvllm:spec_decode_acceptance_rate (0..1), jvllm:spec_decode_mean_accepted_length
  histograms jvllm:time_to_first_token_seconds, jvllm:time_per_output_token_seconds,
            jvllm:inter_token_latency_seconds (each gap between two outputs of a request),
            jvllm:e2e_request_latency_seconds
The families in `VLLM_NAMES` are also exposed under vLLM's own names (`vllm:` prefix, same labels,
same values), so dashboards made for vLLM work unchanged; both read the same observations.
Engine gauges and counters come from the engine thread's last stats snapshot (refreshed after every
step and every command batch, and every 0.2 s when idle), read at scrape time by a custom collector.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
              "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "prefix_cache_queries", "prefix_cache_hits",
              "time_per_output_token_seconds", "num_preemptions", "request_success", "spec_decode_num_drafts",
              "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
              "spec_decode_num_accepted_tokens_per_pos")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0, 20.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


class _EngineCollector:
    def __init__(self, aengine, model_name: str):
        self.aengine = aengine
        self.model_name = model_name

    def collect(self):
        s = self.aengine.stats
        lab = ["model_name"]
        v = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=lab)
            g.add_metric(v, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=lab)
            c.add_metric(v, float(value))
            return c

        nb = s.get("num_blocks", 0)
        yield gauge("jvllm:num_requests_running", "Sequences running in the engine.", s.get("num_running", 0))
        yield gauge("jvllm:num_requests_waiting", "Sequences waiting for an engine slot.", s.get("num_waiting", 0))
        yield gauge("jvllm:num_requests_admitted", "Sequences admitted by the server (running + queued; n counts n).",
                    self.aengine.num_admitted)
        yield gauge("jvllm:kv_cache_usage_perc", "KV block pool usage, 0..1.", s.get("kv_usage", 0.0))
        yield gauge("jvllm:kv_cache_free_blocks", "Free KV blocks (cached-but-unused blocks count as free).",
                    s.get("num_free_blocks", 0))
        yield gauge("jvllm:kv_cache_total_blocks", "Usable KV blocks (the null block excluded).", max(nb - 1, 0))
        yield gauge("jvllm:prefix_cache_hit_rate", "Prefix-cache hit rate over all prompts, 0..1.",
                    s.get("prefix_cache_hit_rate", 0.0))
        yield gauge("jvllm:compiles_after_warmup", "XLA compilations since warm-up (should stay 0).",
                    s.get("compiles_after_warmup", 0))
        yield gauge("jvllm:engine_alive", "1 while the engine loop runs.", 1 if self.aengine.alive else 0)
        yield gauge("jvllm:warmup_pending", "1 while the background warm-up still compiles programs (requests "
                    "served meanwhile may wait for a compile).", 1 if self.aengine.warmup_pending else 0)
        yield counter("jvllm:prompt_tokens", "Prompt tokens computed (prefill).", s.get("num_prompt_tokens", 0))
        yield counter("jvllm:generation_tokens", "Tokens generated.", s.get("num_generation_tokens", 0))
        yield counter("jvllm:num_preemptions", "Sequences preempted.", s.get("num_preemptions", 0))
        if "spec_num_drafts" in s:
            yield counter("jvllm:spec_decode_num_drafts", "Verified rows that carried draft tokens.", s["spec_num_drafts"])
            yield counter("jvllm:spec_decode_num_draft_tokens", "Draft tokens verified.", s["spec_num_draft_tokens"])
            yield counter("jvllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          s["spec_num_accepted_tokens"])
            per = CounterMetricFamily("jvllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.", labels=lab + ["position"])
            for j, n in enumerate(s["spec_accepted_per_position"]):
                per.add_metric(v + [str(j)], float(n))
            yield per
            yield gauge("jvllm:spec_decode_acceptance_rate", "Accepted / verified draft tokens, 0..1.",
                        s["spec_acceptance_rate"])
            yield gauge("jvllm:spec_decode_mean_accepted_length",
                        "Tokens emitted per verified row with drafts (accepted + 1).", s["spec_mean_accepted_length"])


class _VllmNames:
    """Re-emits the families of `sources` named in VLLM_NAMES under the `vllm:` prefix."""

    def __init__(self, sources):
        self.sources = sources
        self.wanted = {"jvllm:" + n for n in VLLM_NAMES}

    def collect(self):
        for src in self.sources:
            for fam in src.collect():
                if fam.name not in self.wanted:
                    continue
                out = Metric("vllm:" + fam.name[len("jvllm:"):], fam.documentation, fam.type, fam.unit)
                out.samples = [smp._replace(name="vllm:" + smp.name[len("jvllm:"):]) for smp in fam.samples]
                yield out


class ServerMetrics:
    """Histograms and counters the server observes, plus the engine collector. `render()` is the
    /metrics body (Prometheus text format 0.0.4)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        ttft = Histogram("jvllm:time_to_first_token_seconds", "Arrival to first generated token.", lab,
                         buckets=_TTFT_BUCKETS, registry=r)
        self.ttft = ttft.labels(model_name)
        itl = Histogram("jvllm:inter_token_latency_seconds", "Time between two outputs of a request.", lab,
                        buckets=_ITL_BUCKETS, registry=r)
        self.itl = itl.labels(model_name)
        e2e = Histogram("jvllm:e2e_request_latency_seconds", "Arrival to finish.", lab, buckets=_E2E_BUCKETS,
                        registry=r)
        self.e2e = e2e.labels(model_name)
        queries = Counter("jvllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lab,
                          registry=r)
        hits = Counter("jvllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lab, registry=r)
        self.prefix_queries, self.prefix_hits = queries.labels(model_name), hits.labels(model_name)
        tpot = Histogram("jvllm:time_per_output_token_seconds", "Mean time per output token after the first, "
                         "per request.", lab, buckets=_TPOT_BUCKETS, registry=r)
        self.tpot = tpot.labels(model_name)
        self._sources = [ttft, tpot, itl, e2e, queries, hits]
        self.success = Counter("jvllm:request_success", "Finished engine requests by finish reason.",
                               lab + ["finished_reason"], registry=r)
        self._sources.append(self.success)
        self.rejected = Counter("jvllm:request_rejected", "HTTP requests refused before reaching the engine.",
                                lab + ["reason"], registry=r)

    def attach_engine(self, aengine):
        """`aengine`: the server's AsyncEngine, or anything with its `stats` (dict), `num_admitted`,
        `alive` and `warmup_pending`, read at every scrape."""
        engine = _EngineCollector(aengine, self.model_name)
        self.registry.register(engine)
        self.registry.register(_VllmNames([engine, *self._sources]))

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int):
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def observe_inter_token(self, seconds: float):
        self.itl.observe(max(0.0, seconds))

    def observe_finished(self, reason: str | None, arrival: float, first: float | None, last: float | None,
                         end: float, tokens0: int):
        """Record one finished engine request (server clock; choice 0 carries the timing). TPOT is
        (last - first) / (tokens - 1); e2e only for requests that finished normally."""
        self.success.labels(self.model_name, reason or "unknown").inc()
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival))
            if tokens0 > 1 and last is not None:
                self.tpot.observe(max(0.0, (last - first) / (tokens0 - 1)))
        if reason in ("stop", "length"):
            self.e2e.observe(max(0.0, end - arrival))

    def reject(self, reason: str):
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics of one server (its own registry: two servers in one process never share counts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..engine import FinalEvent, SlotInfo

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dflash_requests", "Generation requests finished, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.rejected = Counter("dflash_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prompt_tokens_cached = Counter("dflash_prompt_tokens_cached",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.prompt_cache_hits = Counter("dflash_prompt_cache_hits",
                                         "Requests that reused a cached prefix", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "Generated tokens", registry=r)
        self.draft_tokens = Counter("dflash_spec_draft_tokens", "Speculative tokens drafted", registry=r)
        self.accepted_tokens = Counter("dflash_spec_accepted_tokens", "Speculative tokens accepted", registry=r)
        self.prompt_seconds = Counter("dflash_prompt_seconds", "Seconds spent on prefill", registry=r)
        self.decode_seconds = Counter("dflash_decode_seconds", "Seconds spent decoding", registry=r)
        self.decode_tps = Gauge("dflash_decode_tokens_per_second", "Decode tok/s of the last request", registry=r)
        self.prefill_tps = Gauge("dflash_prefill_tokens_per_second", "Prefill tok/s of the last request",
                                 registry=r)
        self.processing = Gauge("dflash_requests_processing", "Requests being generated", registry=r)
        self.queued = Gauge("dflash_requests_queued", "Requests waiting for a free slot", registry=r)
        self.slots = Gauge("dflash_slots", "Slots: requests the engine serves at once", registry=r)
        self.slots_busy = Gauge("dflash_slots_busy", "Slots serving a request", registry=r)
        self.slot_tps = Gauge("dflash_slot_tokens_per_second", "Decode tok/s of the request in each slot (0: idle)",
                              ["slot"], registry=r)

    def observe(self, endpoint: str, final: FinalEvent) -> None:
        t = final.timings
        self.requests.labels(endpoint, final.finish_reason).inc()
        self.prompt_tokens.inc(final.usage.prompt_tokens)
        self.prompt_tokens_cached.inc(final.usage.cached_tokens)
        if final.usage.cached_tokens:
            self.prompt_cache_hits.inc()
        self.generated_tokens.inc(final.usage.completion_tokens)
        self.draft_tokens.inc(t.draft_n)
        self.accepted_tokens.inc(t.draft_n_accepted)
        self.prompt_seconds.inc(t.prompt_ms / 1e3)
        self.decode_seconds.inc(t.predicted_ms / 1e3)
        if t.predicted_n:
            self.decode_tps.set(t.predicted_per_second)
        if t.prompt_n:
            self.prefill_tps.set(t.prompt_per_second)

    def failed(self, endpoint: str) -> None:
        self.requests.labels(endpoint, "error").inc()

    def set_load(self, active: int, slots: int = 1) -> None:
        self.processing.set(min(active, slots))
        self.queued.set(max(active - slots, 0))

    def set_slots(self, slots: list[SlotInfo]) -> None:
        """What the engine's slots do now (read when /metrics is rendered)."""
        self.slots.set(len(slots))
        self.slots_busy.set(sum(s.state != "idle" for s in slots))
        for slot in slots:
            self.slot_tps.labels(str(slot.id)).set(slot.tokens_per_second)

    def render(self) -> bytes:
        return generate_latest(self.registry)

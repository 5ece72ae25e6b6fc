"""Prometheus metrics of the llama-server bridge, through the standard client library."""

from __future__ import annotations

from typing import Any

__all__ = ["BridgeMetrics"]


class BridgeMetrics:
    """Counters and histograms in a private registry, served by the proxy at ``/metrics``."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        buckets = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
        self.hits = Counter("snapstore_llama_hits", "requests whose prefix was restored from the store", registry=r)
        self.misses = Counter("snapstore_llama_misses", "requests with no stored prefix", registry=r)
        self.tokens_served = Counter("snapstore_llama_tokens_served", "prompt tokens restored from the store",
                                     registry=r)
        self.restore_seconds = Histogram("snapstore_llama_restore_seconds", "store -> slot restore latency",
                                         buckets=buckets, registry=r)
        self.save_seconds = Histogram("snapstore_llama_save_seconds", "slot -> store save latency",
                                      buckets=buckets, registry=r)
        self.restored_bytes = Counter("snapstore_llama_restored_bytes", "slot-file bytes restored into slots",
                                      registry=r)
        self.saved_bytes = Counter("snapstore_llama_saved_bytes", "bytes newly stored (after dedup)", registry=r)
        self.saves = Counter("snapstore_llama_saves", "snapshots saved", registry=r)
        self.skipped = Counter("snapstore_llama_skipped_saves", "saves skipped, by reason", ["reason"], registry=r)
        self.evictions = Gauge("snapstore_llama_evictions", "snapshots evicted by the store budget", registry=r)
        self.stored = Gauge("snapstore_llama_stored_bytes", "bytes in the store", registry=r)
        self.entries = Gauge("snapstore_llama_entries", "matchable snapshots in the store", registry=r)
        self.requests = Counter("snapstore_llama_requests", "requests passed through, by path kind", ["kind"],
                                registry=r)

    def events(self) -> Any:
        """BridgeEvents feeding these metrics."""
        from ._bridge import BridgeEvents

        def restore(n: int, dt: float, nbytes: int) -> None:
            self.hits.inc()
            self.tokens_served.inc(n)
            self.restore_seconds.observe(dt)
            self.restored_bytes.inc(nbytes)

        def save(n: int, dt: float, nbytes: int) -> None:
            self.saves.inc()
            self.save_seconds.observe(dt)
            self.saved_bytes.inc(nbytes)

        return BridgeEvents(on_restore=restore, on_miss=self.misses.inc, on_save=save,
                            on_skip=lambda reason: self.skipped.labels(reason=reason).inc())

    def refresh(self, stats: Any) -> None:
        """Copy the store's own counters (evictions, bytes, entries)."""
        if stats is None:
            return
        self.evictions.set(stats.evictions)
        self.stored.set(stats.stored_bytes)
        self.entries.set(stats.entries)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

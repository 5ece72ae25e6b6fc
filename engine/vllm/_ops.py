"""The connector's messages and records: what the scheduler plans per step (loads, saves) and what
it tracks per running request. No vLLM import beyond the metadata base class."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ._key import RequestKey

__all__ = ["LAST_STATS", "NULL_BLOCK", "LoadOp", "SaveOp", "SnapstoreConnectorMetadata", "SnapstoreWorkerMetadata",
           "Track"]

#: the counters of this process's last connector of each role, "scheduler" / "worker" (tests read them)
LAST_STATS: dict[str, dict[str, int]] = {}
NULL_BLOCK = 0  # vLLM's null block (block_pool.null_block): a placeholder, never a request's state


@dataclass
class LoadOp:
    """Restore rows ``[rows_from, n_tokens // block_size)`` of snapshot ``snapshot_id`` (in
    ``namespace``) into ``block_ids``."""

    req_id: str
    snapshot_id: int
    n_tokens: int
    rows_from: int
    block_ids: list[int]
    namespace: str | None = None
    groups: list[list[int]] = field(default_factory=list)  # hybrid: each part's blocks (a state part: one)
    tokens: list[int] | None = None  # tensor parallel: the hit's tokens, each rank finds its own shard by them


@dataclass
class SaveOp:
    """Save ``tokens`` (whole blocks, the request's key) from ``block_ids``, as snapshots at each
    of ``boundaries`` in ``namespace``: the first a delta over ``parent`` (the id of the whole
    stored snapshot the request matched; ``"auto"`` when it matched part of one or nothing; None,
    every row, after a failed load), each later one over the one before it.
    ``recomputed``: planned after the scheduler learnt of a failed load of this request, so its
    blocks were computed again (a save planned before that is dropped by the worker)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    boundaries: list[int]
    namespace: str | None = None
    parent: int | str | None = "auto"
    recomputed: bool = False
    groups: list[list[int]] = field(default_factory=list)  # hybrid: each part's blocks (a state part: one)


@dataclass
class SnapstoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers this step: loads before the forward, saves after it,
    and how many of the step's tokens are prompt tokens (the worker times the forward of a step
    that prefills: ``_rate``)."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    prefill_tokens: int = 0


@dataclass
class SnapstoreWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler after a step: (prefill tokens, forward seconds) of the steps
    it finished timing (``_rate.ForwardClock``). Several workers' (tensor parallel) are pooled."""

    steps: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Every worker's timings together: the rate is their pooled ratio."""
        more = other.steps if isinstance(other, SnapstoreWorkerMetadata) else []
        return SnapstoreWorkerMetadata(self.steps + list(more))


@dataclass
class Track:
    """Scheduler-side view of one running request."""

    key: RequestKey
    blocks: list[int]
    stored: int  # tokens the store already held for it (its match)
    parent: int | str | None  # what its first saved boundary is a delta over (SaveOp.parent)
    saved: bool = False
    failed: bool = False  # a load of it failed: its blocks were recomputed, saves start over
    groups: list[list[int]] = field(default_factory=list)  # hybrid: every group's blocks
    last: int = 0  # hybrid: the last boundary a save was planned at

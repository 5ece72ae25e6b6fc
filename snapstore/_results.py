"""Value objects the API returns: frozen, slotted, JSON-friendly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Considered", "DeleteResult", "LoadResult", "Match", "MatchDetails", "RecomputeDecision",
           "RestoreEstimate", "RestoreResult", "SaveResult", "SnapshotInfo", "Stats"]


@dataclass(frozen=True, slots=True)
class RestoreEstimate:
    """What restoring a snapshot should cost (``Store.estimate_restore``), from the store's own measurements.

    ``seconds``: the estimate; ``bytes``: the chunk bytes the restore reads; ``tiers``: those bytes per
    tier ("ram": the store's RAM tier, "warm": chunk files in the page cache, "cold": chunk files on
    disk, "remote": the shared tier); ``tier``: the tier that costs the most of ``seconds``;
    ``measured``: every tier in ``tiers`` has been measured by this store (False: a default guess
    for at least one, docs/api.md "Restore or recompute"). ``bound``: ``seconds`` is an upper bound,
    the bytes at the slowest local tier's cost, nothing probed (``tiers`` empty, ``tier`` the tier
    assumed): a weighed match takes it where even that restore saves ten times its cost.
    """

    seconds: float
    tier: str
    bytes: int
    measured: bool
    tiers: dict[str, int] = field(default_factory=dict)
    bound: bool = False


@dataclass(frozen=True, slots=True)
class Considered:
    """One stored prefix a match with ``prefill_tokens_per_s`` weighed: its restore estimate and the
    time restoring it saves over reading its tokens (``saved_s``: tokens / rate - restore seconds)."""

    snapshot_id: int
    n_tokens: int
    estimate: RestoreEstimate
    saved_s: float


@dataclass(frozen=True, slots=True)
class RecomputeDecision:
    """Why ``match(..., prefill_tokens_per_s=R)`` returned what it did: the prefixes weighed (longest
    first), the one chosen (None: reading the prompt is faster than any restore) and a sentence."""

    prefill_tokens_per_s: float
    considered: tuple[Considered, ...]
    chosen: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class SaveResult:
    """Outcome of save(): a snapshot id, or ``skipped`` with the reason (budget, not an error)."""

    snapshot_id: int | None
    skipped: str | None
    parent_id: int | None
    stored_bytes: int
    logical_bytes: int
    n_tokens: int = 0
    pending: bool = False
    namespace: str | None = None

    @property
    def ok(self) -> bool:
        """True when the snapshot was stored (or already present)."""
        return self.snapshot_id is not None


@dataclass(frozen=True, slots=True)
class Match:
    """The longest saved prefix of a prompt: restore it, then read tokens from ``n_tokens`` on."""

    snapshot_id: int
    n_tokens: int
    namespace: str | None = None
    # set by match(prefill_tokens_per_s=R): why this prefix (docs/api.md "Restore or recompute")
    why: RecomputeDecision | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True, slots=True)
class MatchDetails:
    """What restoring a snapshot would write (``Store.describe``): size the engine's buffers first.

    ``rows``: valid rows per row stream; ``part_bytes``: bytes per part (fixed parts whole, row
    streams ``rows × row_bytes``) and ``nbytes`` their sum, for the requested components;
    ``components``: the components the snapshot holds; ``missing_components``: requested ones it
    lacks (a restore leaves their destinations untouched); ``chain``: snapshot ids root … leaf;
    ``rows_from``: rows the restore skips (the engine holds them): ``part_bytes`` counts only the
    rest, ``rows`` stays the valid row count. ``snapshot_tokens``: the snapshot's own tokens —
    more than ``n_tokens`` when a block-granular prefix of it was matched (``Store.lookup``).
    """

    snapshot_id: int
    n_tokens: int
    namespace: str | None
    rows: dict[str, int]
    components: frozenset[str]
    missing_components: frozenset[str]
    part_bytes: dict[str, int]
    nbytes: int
    chain: list[int]
    pending: bool = False
    rows_from: int = 0
    snapshot_tokens: int | None = None
    why: RecomputeDecision | None = None  # the match's decision, when it was made with prefill_tokens_per_s


@dataclass(frozen=True, slots=True)
class DeleteResult:
    """What ``Store.delete`` removed: the snapshot ids (deepest first) and the stored bytes freed."""

    snapshot_ids: tuple[int, ...]
    bytes_freed: int

    def __len__(self) -> int:
        return len(self.snapshot_ids)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What a restore wrote: tokens covered, valid rows per stream, components absent, the chain."""

    n_tokens: int
    rows: dict[str, int]
    missing_components: frozenset[str]
    chain: list[int]
    bytes_restored: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``Store.load`` did: the restore's figures (as a :class:`RestoreResult`), the match it
    restored, the plan ``allocate`` was given and the destinations it returned, now filled."""

    n_tokens: int
    rows: dict[str, int]
    missing_components: frozenset[str]
    chain: list[int]
    bytes_restored: int
    seconds: float
    match: Match
    details: MatchDetails
    into: Any  # the mapping allocate() returned (part name -> destination)

    @property
    def snapshot_id(self) -> int:
        """The snapshot restored (a LoadResult names it wherever a snapshot reference is taken)."""
        return self.match.snapshot_id


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """One snapshot as listed by ``Store.snapshots()``."""

    snapshot_id: int
    identity: str
    namespace: str | None
    parent_id: int | None
    n_tokens: int
    depth: int
    session: str | None
    pending: bool
    matchable: bool
    pinned: bool
    created: float
    last_used: float
    hits: int
    logical_bytes: int
    segment_bytes: int
    rows: dict[str, int] = field(default_factory=dict)
    components: list[str] = field(default_factory=list)
    # it (or its chain) reads a quarantined chunk: not matched (``matchable`` False) until a save heals it
    quarantined: bool = False
    # imported under an identity override (Store.import_file(accept_identity=KEY), or saved over such a
    # snapshot): the identity key whose state it holds; never matched, restored by id or name only
    imported_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Stats:
    """Counters an operator can graph; persisted across restarts (hits and misses flushed on use)."""

    entries: int
    snapshots: int
    pending: int
    inserts: int
    hits: int
    misses: int
    hit_tokens: int
    restores: int
    evictions: int
    supersedes: int
    expired: int
    abandoned: int
    stale_dropped: int
    skipped: dict[str, int]
    stored_bytes: int
    logical_bytes: int
    dedup_ratio: float
    ram_hits: int
    ram_bytes: int
    disk_budget: int
    chunks: int
    quarantined: int = 0  # chunks a restore found damaged, not yet healed by a save (or repaired)
    healed: int = 0  # quarantined (or mismatched) chunks a later save republished
    detached: int = 0  # snapshots another session used, taken out of their session instead of superseded
    # the shared tier's counters without their "remote_" prefix (hits, fetched_bytes, corrupt_chunks, ...)
    # and, from an open Store with remote=, its upload queue now (upload_queue, uploading); docs/api.md
    remote: dict[str, int] = field(default_factory=dict)
    # restore or recompute (issue 32): matches that passed over a longer prefix (or returned None) because
    # reading its tokens was estimated faster than restoring it; the time restores saved (estimated
    # prefill of the restored tokens minus the measured restore, seconds); measured restore rates (bytes/s per tier)
    recompute_skipped: int = 0
    restore_saved_s: float = 0.0
    restore_rates: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

"""Configuration: keyword arguments, then SNAPSTORE_* environment variables, then defaults."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

import platformdirs

from snapstore._errors import ConfigError
from snapstore._layout import Layout
from snapstore._numbers import MAX_INT, integer, real

__all__ = ["Budget", "StoreOptions", "default_dir", "env_flag", "env_int", "env_seconds", "pending_lease",
           "resolved_budget", "store_options"]

MIB = 1 << 20
DEFAULT_DISK_MIB = 51200
DEFAULT_RAM_MIB = 2048
DEFAULT_RESERVE_MIB = 1024
# Lease of a pending capture's owner, renewed every lease/4. Only owners nothing can probe (another
# kernel: another host, or a lock that cannot be opened) depend on it; 5 minutes bounds how long a
# dead pod's captures stay pinned while surviving a stalled renewal (a long write lock, a paused VM).
DEFAULT_PENDING_LEASE_S = 300.0
MIN_PENDING_LEASE_S = 0.5


def env_int(name: str) -> int | None:
    """An integer environment variable, or None when unset; ConfigError when malformed."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"${name} must be >= 0, got {value}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """An on/off setting from environment variable ``name`` (``default`` when unset or blank): 0/1,
    true/false, yes/no or on/off; ConfigError otherwise. The one parse of every boolean setting."""
    flag = os.environ.get(name, "").strip().lower()
    if not flag:
        return default
    if flag in ("1", "true", "yes", "on"):
        return True
    if flag in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"${name} must be 0/1 (or true/false), got {flag!r}")


def env_seconds(name: str, default: float) -> float:
    """A duration in seconds from environment variable ``name`` (``default`` when unset or blank);
    ConfigError when it is not a number or not > 0."""
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"${name} must be a number of seconds, got {raw!r}") from None
    return real(value, f"${name}", above=0.0, unit="seconds", err=ConfigError)


def pending_lease(value: float | None) -> float:
    """The pending-capture lease in seconds: the keyword, else ``$SNAPSTORE_PENDING_LEASE_S``, else 300."""
    source = "pending_lease"
    if value is None:
        raw = os.environ.get("SNAPSTORE_PENDING_LEASE_S", "").strip()
        if not raw:
            return DEFAULT_PENDING_LEASE_S
        source = "$SNAPSTORE_PENDING_LEASE_S"
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"$SNAPSTORE_PENDING_LEASE_S must be a number of seconds, got {raw!r}") from None
    return real(value, source, minimum=MIN_PENDING_LEASE_S, unit="seconds", err=ConfigError)


def default_dir() -> str:
    """``$SNAPSTORE_DIR``, else the platform's per-user cache directory for snapstore."""
    return os.environ.get("SNAPSTORE_DIR") or platformdirs.user_cache_dir("snapstore", appauthor=False)


def _budget_field(name: str, value: object) -> int | float | None:
    """One Budget field checked (the one numeric check, :mod:`snapstore._numbers`) and normalised:
    ``ttl`` a float of seconds, the counts and byte sizes ints (a real number is truncated, as
    before); None stays None (from the environment, else the default)."""
    if value is None:
        return None
    what = f"Budget.{name}"
    if name == "ttl":
        return real(value, what, minimum=0.0, unit="seconds", err=ConfigError)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return integer(value, what, minimum=0, err=ConfigError)
    return int(real(value, what, minimum=0.0, maximum=float(MAX_INT), err=ConfigError))


@dataclass(frozen=True)
class Budget:
    """Capacity limits of a store. ``None`` means: from the environment, else the default.

    disk_bytes: stored bytes (each chunk once) — default 51200 MiB (``SNAPSTORE_DISK_MIB``).
    ram_bytes: the in-process RAM tier of decoded chunks — 2048 MiB (``SNAPSTORE_RAM_MIB``; 0 = off).
    max_entries: matchable snapshots — unlimited (``SNAPSTORE_MAX_ENTRIES``).
    ttl: seconds since last use before a snapshot expires — none (``SNAPSTORE_TTL``).
    reserve_bytes: free space always left on the file system — 1024 MiB (``SNAPSTORE_RESERVE_MIB``).
    write_bytes_per_hour: the rate saves may write at, as a token bucket shared by the store's
    processes; saves beyond it are skipped (``write_budget``), never blocked — unlimited
    (``SNAPSTORE_WRITE_BYTES_PER_HOUR``; 0 = unlimited; :mod:`snapstore.lifecycle.admission`).
    """

    disk_bytes: int | None = None
    ram_bytes: int | None = None
    max_entries: int | None = None
    ttl: float | None = None
    reserve_bytes: int | None = None
    write_bytes_per_hour: int | None = None

    def __post_init__(self) -> None:
        for name in ("disk_bytes", "ram_bytes", "max_entries", "ttl", "reserve_bytes", "write_bytes_per_hour"):
            object.__setattr__(self, name, _budget_field(name, getattr(self, name)))

    def resolved(self) -> Budget:
        """A copy with every unset field taken from the environment or the default."""
        def pick(value: int | float | None, env: str, default: int | None, scale: int = 1) -> int | float | None:
            if value is not None:
                return value
            e = env_int(env)
            if e is not None:
                return e * scale
            return default * scale if default is not None else None

        ttl = pick(self.ttl, "SNAPSTORE_TTL", None)
        max_entries = pick(self.max_entries, "SNAPSTORE_MAX_ENTRIES", None)
        rate = pick(self.write_bytes_per_hour, "SNAPSTORE_WRITE_BYTES_PER_HOUR", None)
        return replace(
            self,
            disk_bytes=int(pick(self.disk_bytes, "SNAPSTORE_DISK_MIB", DEFAULT_DISK_MIB, MIB) or 0),
            ram_bytes=int(pick(self.ram_bytes, "SNAPSTORE_RAM_MIB", DEFAULT_RAM_MIB, MIB) or 0),
            max_entries=int(max_entries) if max_entries is not None else None,
            ttl=float(ttl) if ttl is not None and ttl > 0 else None,
            reserve_bytes=int(pick(self.reserve_bytes, "SNAPSTORE_RESERVE_MIB", DEFAULT_RESERVE_MIB, MIB) or 0),
            write_bytes_per_hour=int(rate) if rate else None,
        )

    @classmethod
    def for_model(cls, layout: Layout, *, conversations: int, tokens: int, headroom: float = 1.25,
                  **kw: int | float | None) -> Budget:
        """A disk budget that holds ``conversations`` conversations of ``tokens`` tokens each.

        Per conversation: ``tokens`` rows of every stream plus one set of fixed parts (supersede
        keeps one matchable snapshot per session; ancestors keep only their rows), times
        ``headroom`` for branches and boundary snapshots still pinned.
        """
        if not isinstance(layout, Layout):
            raise ConfigError(f"for_model needs a snapstore.Layout, got {type(layout).__name__}")
        conversations = integer(conversations, "conversations", minimum=1, err=ConfigError)
        tokens = integer(tokens, "tokens", minimum=1, err=ConfigError)
        headroom = real(headroom, "headroom", minimum=1.0, err=ConfigError)
        if "disk_bytes" in kw:
            raise ConfigError("for_model computes disk_bytes: give the other Budget fields only")
        per = tokens * layout.bytes_per_token + layout.fixed_bytes
        return cls(disk_bytes=int(conversations * per * headroom), **kw)  # type: ignore[arg-type]


def resolved_budget(budget: object) -> Budget:
    """Store.open's ``budget``: a Budget (or None: every field from the environment, else the default),
    resolved; ConfigError saying what a budget is for anything else (``budget=1000``)."""
    if budget is not None and not isinstance(budget, Budget):
        raise ConfigError(f"budget must be None or a snapstore.Budget, got {type(budget).__name__} {budget!r:.60}: "
                          "sizes are fields, e.g. budget=snapstore.Budget(disk_bytes=...) (docs/api.md)")
    return (budget or Budget()).resolved()


DEFAULT_CHUNK_MIB = 16  # 4 chunks in flight in the default staging: docs/benchmarks.md ("Issue 12, save pipeline")
DEFAULT_STAGING_MIB = 64
MAX_STAGING_BYTES = 1 << 40  # 1 TiB: a staging buffer is allocated whole, on a save's first chunk
MAX_STAGING_SLOTS = 1 << 16  # chunks in flight at most (each slot is a list entry and a frame)


@dataclass(frozen=True)
class StoreOptions:
    """Store.open's knobs, resolved: keyword, then ``SNAPSTORE_*`` environment, then default."""

    root: str
    chunk_bytes: int
    codec: str
    staging_bytes: int
    check_rows: bool
    pending_lease: float


def store_options(path: str | os.PathLike[str] | None, *, chunk_bytes: int | None, codec: str | None,
                  staging_bytes: int | None, check_rows: bool | None, pending_lease: float | None,
                  codecs: Iterable[str]) -> StoreOptions:
    """Resolve and check Store.open's options (ConfigError with the fix for a bad one)."""
    env_chunk, env_staging = env_int("SNAPSTORE_CHUNK_MIB"), env_int("SNAPSTORE_STAGING_MIB")
    if env_chunk == 0 or env_staging == 0:
        raise ConfigError("$SNAPSTORE_CHUNK_MIB and $SNAPSTORE_STAGING_MIB must be >= 1")
    chunk = integer(chunk_bytes, "chunk_bytes", err=ConfigError) if chunk_bytes is not None \
        else (env_chunk or DEFAULT_CHUNK_MIB) * MIB
    staging = integer(staging_bytes, "staging_bytes", err=ConfigError) if staging_bytes is not None \
        else (env_staging or DEFAULT_STAGING_MIB) * MIB
    if chunk < 4096 or chunk % 4096 or chunk > (1 << 30):
        raise ConfigError(f"chunk_bytes must be a multiple of 4096 in [4 KiB, 1 GiB], got {chunk!r}")
    if staging < chunk:
        raise ConfigError(f"staging_bytes ({staging}) must be >= chunk_bytes ({chunk}): chunks are "
                          "bounded by the staging buffer")
    if staging > MAX_STAGING_BYTES or staging // chunk > MAX_STAGING_SLOTS:
        raise ConfigError(f"staging_bytes ({staging}) must be at most {MAX_STAGING_BYTES >> 30} GiB and hold at most "
                          f"{MAX_STAGING_SLOTS} chunks of chunk_bytes ({chunk}); it bounds a save's memory "
                          f"(default {DEFAULT_STAGING_MIB} MiB)")
    codec_name = codec if codec is not None else os.environ.get("SNAPSTORE_CODEC", "raw")
    known = sorted(codecs)
    if codec_name not in known:
        raise ConfigError(f"codec must be one of {known}, got {codec_name!r}")
    if check_rows is None:
        check_rows = env_flag("SNAPSTORE_CHECK_ROWS", False)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a directory path or None, got {path!r}")
    root = os.fspath(path) if path is not None else default_dir()
    if not isinstance(root, str):
        raise ConfigError(f"path must be a str (or os.PathLike of str), got {path!r}")
    if not root.strip():
        # "" would silently become the current directory; None is how to ask for the default
        raise ConfigError(f"store path {root!r} is empty; pass a directory, or path=None for "
                          "$SNAPSTORE_DIR / the per-user cache directory")
    return StoreOptions(root, chunk, codec_name, staging, bool(check_rows), _resolve_lease(pending_lease))


_resolve_lease = pending_lease  # store_options() takes a keyword of the same name

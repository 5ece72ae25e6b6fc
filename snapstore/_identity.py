"""Identity: what makes saved state compatible with a running engine, and its canonical key."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from snapstore._errors import ConfigError

__all__ = ["Identity", "canonical_json"]

_SCALARS = (str, int, float, bool, type(None))


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII: the same value always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@dataclass(frozen=True)
class Identity:
    """Engine build, model pack hash, KV mode, MTP/draft flag and free-form extra keys.

    Two engines may share snapshots only when their identities are equal; the canonical key
    (``identity.key``) is what the store indexes.
    """

    build: str
    pack: str
    kv: str = "f16"
    mtp: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("build", "pack", "kv"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"Identity.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.mtp, bool):
            raise ConfigError(f"Identity.mtp must be a bool, got {self.mtp!r}")
        if not isinstance(self.extra, Mapping):
            raise ConfigError("Identity.extra must be a mapping of str to JSON scalars")
        for k, v in self.extra.items():
            if not isinstance(k, str) or not isinstance(v, _SCALARS) or (isinstance(v, float) and not math.isfinite(v)):
                raise ConfigError(
                    f"Identity.extra[{k!r}] must map a str to a str/int/float/bool/None, got {v!r}"
                )
        object.__setattr__(self, "extra", dict(sorted(self.extra.items())))

    def to_dict(self) -> dict[str, Any]:
        """The identity as a plain JSON-able dict (the form stored in the database)."""
        return {"build": self.build, "pack": self.pack, "kv": self.kv, "mtp": self.mtp,
                "extra": dict(self.extra)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Identity:
        """Inverse of :meth:`to_dict`; raises ConfigError on malformed input."""
        try:
            return cls(build=d["build"], pack=d["pack"], kv=d["kv"], mtp=d["mtp"],
                       extra=d.get("extra", {}))
        except (KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"malformed identity record: {e}") from None

    @property
    def canonical(self) -> str:
        """Canonical JSON of the identity."""
        return canonical_json(self.to_dict())

    @property
    def key(self) -> str:
        """Stable identity key: ``id-`` + the first 32 hex digits of SHA-256 of the canonical JSON."""
        return "id-" + hashlib.sha256(self.canonical.encode()).hexdigest()[:32]

    def __hash__(self) -> int:
        return hash(self.canonical)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and self.canonical == other.canonical

"""The S3 client wrapper: the only module that talks to object storage.

Built on obstore (Rust object_store; measured against boto3 on the same bytes, see
docs/benchmarks.md "Shared tier"): one wheel without dependencies, GETs that stream without
holding the GIL, and ``If-None-Match: *`` as ``mode="create"``. Endpoint, region and credentials
come from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, web identity, ECS/EC2
instance roles); with ``AWS_PROFILE`` set and boto3 installed, boto3's full config chain
(profiles, SSO) supplies the credentials. Every failure becomes a :class:`RemoteError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from snapstore._config import env_seconds
from snapstore._errors import ConfigError, RemoteError

__all__ = ["ObjectInfo", "S3Client", "parse_url"]

T = TypeVar("T")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX = re.compile(r"^[A-Za-z0-9._\-/]*$")


def parse_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix without slashes at either end); ConfigError if malformed."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ConfigError(f"remote must be an s3://BUCKET/PREFIX url, got {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket):
        raise ConfigError(f"remote {url!r}: {bucket!r} is not a valid bucket name")
    if not _PREFIX.match(prefix) or ".." in prefix.split("/") or "//" in prefix:
        raise ConfigError(f"remote {url!r}: the prefix may hold only letters, digits, '._-/'")
    return bucket, prefix


@dataclass(frozen=True)
class ObjectInfo:
    """What a HEAD or a LIST says about one object (``key`` relative to the tier's prefix)."""

    key: str
    size: int
    modified: float  # the server's LastModified, seconds since the epoch


def _timeout() -> float:
    return env_seconds("SNAPSTORE_REMOTE_TIMEOUT_S", 30.0)


class S3Client:
    """One bucket + prefix. Thread-safe (obstore stores are)."""

    def __init__(self, url: str):
        try:
            import obstore
            import obstore.exceptions as obx
            from obstore.store import S3Store
        except ImportError:
            raise ConfigError("the shared tier needs obstore: pip install 'snapstore[s3]'") from None
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        self._ob = obstore
        self._x = obx
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        timeout = _timeout()
        kw: dict[str, Any] = {"region": region}
        if endpoint:
            kw["endpoint"] = endpoint
        if os.environ.get("AWS_PROFILE"):
            try:
                from obstore.auth.boto3 import Boto3CredentialProvider
                kw["credential_provider"] = Boto3CredentialProvider()
            except ImportError:
                pass  # obstore's own chain: environment, web identity, instance roles
        client_options: Any = {"timeout": timedelta(seconds=timeout),
                                          "connect_timeout": timedelta(seconds=min(timeout, 5.0)),
                                          "allow_http": bool(endpoint and endpoint.startswith("http://"))}
        retry: Any = {"max_retries": 4, "retry_timeout": timedelta(seconds=timeout),
                 "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=2),
                             "base": 2}}
        try:
            self._store = S3Store(self.bucket, prefix=self.prefix or None, client_options=client_options,
                                  retry_config=retry, **kw)
        except Exception as e:  # obstore raises its own config errors
            raise ConfigError(f"cannot configure the S3 client for {url}: {e}") from None

    # -- errors ------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:
            raise RemoteError(5, f"{self.url}: {what} failed: {_short(e)}") from None

    def _missing(self, e: BaseException) -> bool:
        return isinstance(e, (self._x.NotFoundError, FileNotFoundError))

    # -- objects -----------------------------------------------------------------------------
    def put_new(self, key: str, data: bytes | memoryview) -> bool:
        """PUT with ``If-None-Match: *``: True if this call created it, False if it already existed."""
        try:
            self._ob.put(self._store, key, data, mode="create", use_multipart=False)
            return True
        except (self._x.AlreadyExistsError, self._x.PreconditionError):
            return False
        except Exception as e:
            raise RemoteError(5, f"{self.url}: conditional PUT of {key} failed: {_short(e)}") from None

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Unconditional PUT (leases and last-use markers only: never chunks or manifests)."""
        self._call(f"PUT {key}", lambda: self._ob.put(self._store, key, data, use_multipart=False))

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and LastModified, or None when it does not exist."""
        try:
            meta = self._ob.head(self._store, key)
        except Exception as e:
            if self._missing(e):
                return None
            raise RemoteError(5, f"{self.url}: HEAD {key} failed: {_short(e)}") from None
        return _info(meta)

    def get(self, key: str, limit: int) -> bytes | None:
        """The whole object (at most ``limit`` bytes, else RemoteError), or None when missing."""
        try:
            res = self._ob.get(self._store, key)
            size = int(res.meta["size"])
            if size > limit:
                raise RemoteError(27, f"{self.url}: {key} is {size} bytes, over the {limit}-byte limit")
            return bytes(res.bytes())
        except RemoteError:
            raise
        except Exception as e:
            if self._missing(e):
                return None
            raise RemoteError(5, f"{self.url}: GET {key} failed: {_short(e)}") from None

    def stream(self, key: str, piece: int = 8 << 20) -> tuple[int, Iterator[memoryview]] | None:
        """(size, pieces) of the object, streamed without holding it whole; None when missing."""
        try:
            res = self._ob.get(self._store, key)
        except Exception as e:
            if self._missing(e):
                return None
            raise RemoteError(5, f"{self.url}: GET {key} failed: {_short(e)}") from None

        def pieces() -> Iterator[memoryview]:
            try:
                for buf in res.stream(min_chunk_size=piece):
                    yield memoryview(buf)
            except Exception as e:
                raise RemoteError(5, f"{self.url}: reading {key} failed: {_short(e)}") from None

        return int(res.meta["size"]), pieces()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a key prefix ending in '/'): maintenance and one anchor's manifests."""
        try:
            for batch in self._ob.list(self._store, prefix=prefix, chunk_size=1000):
                for meta in batch:
                    yield _info(meta)
        except Exception as e:
            raise RemoteError(5, f"{self.url}: LIST {prefix} failed: {_short(e)}") from None

    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects (missing ones are not an error)."""
        for key in keys:
            try:
                self._ob.delete(self._store, key)
            except Exception as e:
                if self._missing(e):
                    continue
                raise RemoteError(5, f"{self.url}: DELETE {key} failed: {_short(e)}") from None


def _info(meta: Any) -> ObjectInfo:
    return ObjectInfo(str(meta["path"]), int(meta["size"]), float(meta["last_modified"].timestamp()))


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"

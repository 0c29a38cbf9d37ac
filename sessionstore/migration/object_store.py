"""One S3 prefix of the object-store tier (FORMAT.md 6.4): its keys, its requests, and how a
failure of the store becomes one :class:`RemoteStoreError` line.

Objects under the prefix::

    leases/<id>.json                               the lease AND the pointer to the current bundle
    bundles/<id>/g<generation>-<token>.colibundle  bundles (immutable; superseded ones are deleted)

Endpoint and credentials: the AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)
or ``storage_options`` (fsspec/s3fs options), so AWS S3, MinIO and Ceph RGW all work.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError
from sessionstore.log import get_logger
from sessionstore.migration.transport import store_errors, url_filesystem

log = get_logger("remote")

CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})


class RemoteStoreError(ColiError):
    """The object store failed an operation (unreachable, bucket missing, request refused)."""

    exit_code = 1


def error_code(exc: BaseException) -> tuple[str, str]:
    """(S3 error code, HTTP status) of a failed request, from botocore's response if any."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return (str(response.get("Error", {}).get("Code", "")),
                    str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
    return "", ""


def is_conflict(exc: BaseException, *, if_match: bool = False) -> bool:
    """Whether a failed request is the store refusing a conditional write or delete (409/412).

    ``if_match``: the request was conditional on an object being there (``If-Match``). A store
    that no longer has that object refuses it differently (FORMAT.md 6.4, "What stores answer"):
    AWS and moto answer 404 ``NoSuchKey``, SeaweedFS 412; both mean the object we read is not
    there any more, the same refusal."""
    if isinstance(exc, FileExistsError):
        return True
    if if_match and isinstance(exc, FileNotFoundError) and not no_bucket(exc):
        return True
    code, status = error_code(exc)
    if code or status:
        return (code in CONFLICT_CODES or status in ("409", "412")
                or (if_match and code == "NoSuchKey"))
    return "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower()


def no_bucket(exc: BaseException) -> bool:
    """Whether a failed request says the bucket does not exist."""
    return error_code(exc)[0] == "NoSuchBucket" or "bucket does not exist" in str(exc).lower()


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class ObjectPrefix:
    """``s3://bucket/prefix``: keys under it, requests on its bucket, failures as one line."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, path = url_filesystem(self.url, storage_options)
        self.bucket, _, self.prefix = path.partition("/")
        if not self.bucket:
            raise FormatError(f"{url}: no bucket")

    def key(self, *parts: str) -> str:
        """The key (under the bucket) of ``parts`` joined under the prefix."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def call(self, operation: str, **params: Any) -> Any:
        """One S3 request on this bucket (``operation`` as botocore names it)."""
        return self.fs.call_s3(operation, Bucket=self.bucket, **params)

    @contextmanager
    def failing(self, what: str, session_id: str | None) -> Iterator[None]:
        """Turn a failure of the store inside the block into one RemoteStoreError line."""
        try:
            yield
        except ColiError:
            raise
        except store_errors() as exc:
            raise RemoteStoreError(self.failure(what, session_id, exc)) from None

    def failure(self, what: str, session_id: str | None, exc: BaseException) -> str:
        if no_bucket(exc):
            reason = (f"the bucket {self.bucket!r} does not exist (the store lost its data, or the "
                      "URL names the wrong bucket)")
        else:
            reason = one_line(exc) or type(exc).__name__
        whose = f" for session {session_id!r}" if session_id else ""
        return f"remote object store {self.url}: {what}{whose} failed: {reason}"

    def read_small(self, key: str, max_bytes: int) -> tuple[bytes, str] | None:
        """One small object's bytes and ETag, or None when there is none (a missing bucket is
        raised); an object over ``max_bytes`` is a LimitError before its body is read."""
        from fsspec.asyn import sync

        try:
            resp = self.call("get_object", Key=key)
        except FileNotFoundError as exc:
            if no_bucket(exc):
                raise
            return None
        size = int(resp.get("ContentLength") or 0)
        if size > max_bytes:
            raise LimitError(f"{self.url_of(key)}: an object of {size} bytes exceeds {max_bytes}")
        data: bytes = sync(self.fs.loop, resp["Body"].read)
        return data, str(resp.get("ETag", ""))

    def delete(self, key: str) -> None:
        """Delete one object, best effort (logged when the store cannot)."""
        try:
            self.call("delete_object", Key=key)
            self.fs.invalidate_cache(f"{self.bucket}/{key}")
        except store_errors() as exc:
            log.info("remote.delete_failed", key=key, error=one_line(exc))


__all__ = [
    "CONFLICT_CODES",
    "ObjectPrefix",
    "RemoteStoreError",
    "error_code",
    "is_conflict",
    "no_bucket",
    "one_line",
]

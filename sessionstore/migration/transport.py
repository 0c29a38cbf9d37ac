"""Where bundles go and come from: a local path, ``-`` (stdout/stdin) or an fsspec URL.

Sinks are all-or-nothing: a local file is written as ``<dest>.<owner>-<random>.partial`` beside
the destination (unbuffered, its write-back started as it grows), fsynced, then renamed into place
(and the directory fsynced), so an inbox or a reader never sees a half-written bundle under the
final name; the next export to ``<dest>`` sweeps the partials of dead owners (sweep.py). An fsspec
object (``s3://...``)
appears only when its upload completes, and an aborted upload is discarded. On stdout an
aborted bundle simply stops before its trailer, which every reader refuses.

Endpoint and credentials of object stores come from fsspec/botocore's usual sources: the
``AWS_*`` environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), config files,
or ``storage_options`` passed through.

``http(s)://HOST:PORT/ID`` names a session on a ``coli-kv serve --http`` server
(http_upload.py, http_transport.py): a sink PUTs the bundle there, a source GETs it.
"""
from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from kernels.errors import ColiError, FormatError, NotFoundError
from sessionstore.kvfile import fsync_parent, sweep_beside, temp_beside
from sessionstore.log import get_logger
from sessionstore.migration.bundle_io import WritebackFile
from sessionstore.migration.http_transport import HttpOptions, http_source, is_http
from sessionstore.migration.http_upload import http_sink

log = get_logger("transport")

PARTIAL_SUFFIX = ".partial"
LEGACY_PARTIAL = r"[0-9a-f]{8}\.partial"  # <dest>.<hex>.partial of older versions: no owner recorded
SINK_BUFFER_BYTES = 1 << 20
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(target: str) -> bool:
    """``scheme://...`` (``file://`` included)."""
    return bool(_URL_RE.match(target))


def describe(target: str) -> str:
    return "<stdout/stdin>" if target == "-" else target


def _local_path(target: str) -> str | None:
    """The local path a target names (``file://`` URLs included), or None for other URLs."""
    if target.startswith("file://"):
        return target[len("file://"):]
    return None if is_url(target) else target


@dataclass
class SinkInfo:
    target: str
    final_path: str | None = None  # the local file, once committed
    kind: str = "file"  # file | stdout | url | http
    reply: dict[str, Any] | None = None  # http: the server's description of the installed session


@contextmanager
def open_sink(dest: str, *, overwrite: bool = False, durable: bool = True,
              storage_options: dict[str, Any] | None = None,
              http: HttpOptions | None = None) -> Iterator[tuple[BinaryIO, SinkInfo]]:
    """A binary sink for one bundle; committed when the block exits normally, discarded on error.
    (``http(s)://``: ``overwrite`` lets the server replace its session of that id.)"""
    if is_http(dest):
        with http_sink(dest, http or HttpOptions(), replace=overwrite) as (upload, outcome):
            info = SinkInfo(outcome.url, kind="http")
            yield upload, info
        info.reply = outcome.reply
        return
    if dest == "-":
        out = sys.stdout.buffer
        if out.isatty():
            raise FormatError("refusing to write a binary bundle to a terminal; redirect stdout "
                              "or give a file name")
        yield out, SinkInfo(dest, kind="stdout")
        out.flush()
        return
    local = _local_path(dest)
    if local is None:
        with _url_sink(dest, overwrite, storage_options) as pair:
            yield pair
        return
    with _file_sink(local, overwrite, durable) as pair:
        yield pair


@contextmanager
def _file_sink(path: str, overwrite: bool, durable: bool) -> Iterator[tuple[BinaryIO, SinkInfo]]:
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: exists and is not a regular file; refusing to replace it")
        if not overwrite:
            raise FormatError(f"{path}: exists; refusing to overwrite it (give --force)")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise NotFoundError(f"{directory}: no such directory for the bundle")
    sweep_beside(path, PARTIAL_SUFFIX, legacy=LEGACY_PARTIAL)  # a killed export's debris
    partial = temp_beside(path, PARTIAL_SUFFIX)  # <dest>.<owner>-<hex>.partial
    handle = WritebackFile.create(partial)
    try:
        yield cast(BinaryIO, handle), SinkInfo(path, final_path=path, kind="file")
        if durable:
            handle.sync()
        handle.close()
        os.replace(partial, path)
        if durable:
            fsync_parent(path)
    except BaseException:
        handle.close()
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise


@contextmanager
def _url_sink(url: str, overwrite: bool, storage_options: dict[str, Any] | None
              ) -> Iterator[tuple[BinaryIO, SinkInfo]]:
    fs, path = url_filesystem(url, storage_options)
    if not overwrite and fs.exists(path):
        raise FormatError(f"{url}: exists; refusing to overwrite it (give --force)")
    handle = fs.open(path, "wb")
    try:
        yield handle, SinkInfo(url, kind="url")
    except BaseException:
        discard_upload(handle)
        raise
    try:
        handle.close()  # completes the upload: the object appears whole or not at all
    except BaseException:
        discard_upload(handle)  # a failed completion must not leave a multipart upload behind
        raise


def store_errors() -> tuple[type[BaseException], ...]:
    """What a failing object store raises through fsspec/s3fs: OSError (s3fs translates most
    answers), botocore's and aiohttp's errors, timeouts."""
    global _STORE_ERRORS
    if _STORE_ERRORS is None:
        found: list[type[BaseException]] = [OSError, TimeoutError]
        try:
            from botocore.exceptions import BotoCoreError, ClientError

            found += [BotoCoreError, ClientError]
        except ImportError:
            pass
        try:
            from aiohttp import ClientError as HttpClientError

            found.append(HttpClientError)
        except ImportError:
            pass
        _STORE_ERRORS = tuple(found)
    return _STORE_ERRORS


_STORE_ERRORS: tuple[type[BaseException], ...] | None = None


def _quiet_loop(loop: Any) -> None:
    """Route what fsspec's I/O loop reports on its own (tasks of a request that failed, whose
    exception nobody retrieves: "Cannot write to closing transport", ...) to our debug log: the
    request's failure already reaches its caller once, as one error."""
    if getattr(loop, "_coli_quiet", False):
        return

    def handler(_loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        log.debug("transport.loop_exception", message=context.get("message"),
                  error=" ".join(str(exc).split()) if exc is not None else None)

    loop.set_exception_handler(handler)
    loop._coli_quiet = True


def discard_upload(handle: Any) -> None:
    """Abandon an fsspec upload so that no partial object is ever committed."""
    try:
        discard = getattr(handle, "discard", None)
        if callable(discard):
            discard()
    except Exception as exc:  # best effort: the object was never completed either way
        log.info("transport.discard_failed", error=str(exc))  # the upload's error is the one shown
    finally:
        handle.closed = True  # close()/__del__ must not flush a partial bundle into place


def url_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path) for a URL; a missing backend is one clear error."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise ColiError(f"{url}: no fsspec backend for this URL ({exc}); for s3:// install "
                        "s3fs (pip install 'coli-sessionstore[s3]')") from None
    except ValueError as exc:
        raise FormatError(f"{url}: not a usable URL: {exc}") from None
    loop = getattr(fs, "loop", None)
    if loop is not None:
        _quiet_loop(loop)
    return fs, path


@contextmanager
def open_source(src: str, *, storage_options: dict[str, Any] | None = None,
                http: HttpOptions | None = None) -> Iterator[BinaryIO]:
    """A binary source for one bundle (read front to back only)."""
    if is_http(src):
        with http_source(src, http or HttpOptions()) as download:
            yield download
        return
    if src == "-":
        stream = sys.stdin.buffer
        if stream.isatty():
            raise FormatError("refusing to read a binary bundle from a terminal; pipe it in "
                              "or give a file name")
        yield stream
        return
    local = _local_path(src)
    if local is not None:
        try:
            st = os.stat(local)
        except FileNotFoundError:
            raise NotFoundError(f"{local}: no such bundle") from None
        if stat.S_ISDIR(st.st_mode):
            raise FormatError(f"{local}: is a directory, not a bundle")
        with open(local, "rb", buffering=SINK_BUFFER_BYTES) as handle:
            yield handle
        return
    fs, path = url_filesystem(src, storage_options)
    try:
        handle = fs.open(path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"{src}: no such bundle") from None
    with handle:
        yield handle


__all__ = ["PARTIAL_SUFFIX", "SinkInfo", "is_url", "describe", "open_sink", "open_source",
           "url_filesystem", "discard_upload", "store_errors"]

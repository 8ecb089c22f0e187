"""Checkpoint storage on any fsspec URL: S3 and S3-compatible stores, GCS, Azure, HDFS, memory.

S3 (``s3://``, ``s3a://``) goes straight to the S3 API through s3fs's async client
(:mod:`tessera.storage._s3`), because a checkpoint needs guarantees the generic file
interface does not give:

* ``write_file`` streams the chunks into a multipart upload: they are copied into at most
  ``max_concurrency + 1`` part buffers of ``part_size`` bytes, so memory stays bounded
  whatever the file size, while up to ``max_concurrency`` parts upload at once. A file smaller
  than one part is a single PUT. A failed upload is aborted, never completed.
* ``write_atomic`` (the commit) is one PUT of the whole object: S3 readers see the old object
  or the new one, never a mix. Object stores have no rename, and need none.
* ``read_into`` issues ranged GETs (``part_size`` pieces, fetched concurrently) and streams
  the bytes straight into the caller's buffer.

Every other protocol goes through the fsspec ``AbstractFileSystem`` methods (``open``,
``cat_file``, ``pipe_file``, ``find``...). On hierarchical filesystems (``file``, ``hdfs``,
``sftp``...) ``write_atomic`` writes a temporary file and renames it; on object stores (and
``memory``) it is one ``pipe_file`` call.

Transient failures (throttling such as S3 ``SlowDown``/HTTP 503, timeouts, dropped
connections, 5xx answers) are retried with exponential backoff and jitter, up to
:attr:`RetryOptions.max_attempts` attempts per request; then a
:class:`~tessera.errors.StorageError` names the operation, the URL and the cause. A missing
file raises ``FileNotFoundError``. On S3, botocore's own retries are turned off so that this
one policy applies, once (``config_kwargs={"retries": ...}`` in ``storage_options`` turns
them back on). On other protocols only writes whose chunks are a list or tuple are retried
as a whole: a one-shot iterator cannot be replayed.

Thread safety: every method may be called from many threads at once. S3 requests run on
fsspec's shared I/O event loop; the calling thread blocks until its request is done.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

from ..errors import ConcurrentSaveError, StorageError
from ..format.names import check_relpath
from ._retry import RetryOptions, Truncated, call_with_retry, failure
from ._s3 import S3Objects, s3_filesystem
from .base import Buffer, temp_name

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20

# Protocols whose single-object write is atomic for readers and that have no cheap rename.
_OBJECT_STORE_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "memory", "r2", "cos"}
)


class FsspecStorage:
    """Checkpoint storage on any fsspec URL (``s3://``, ``gs://``, ``memory://``, ``hdfs://``...).

    Every rank may hold its own instance for the same URL; instances are thread-safe.

    Args:
        url: the checkpoint root, e.g. ``s3://bucket/runs/7/step-100``.
        storage_options: passed to the fsspec filesystem. For S3: ``key``, ``secret``,
            ``token``, ``anon``, ``client_kwargs={"endpoint_url": ..., "region_name": ...}``,
            ``config_kwargs`` (a botocore ``Config``), ``s3_additional_kwargs`` (e.g.
            server-side encryption)... Without them, the usual AWS environment variables,
            ``~/.aws`` files and instance roles apply.
        part_size: bytes per multipart part and per ranged GET on S3 (at least 5 MiB there;
            doubled every 2,000 parts so that large files stay under S3's 10,000 parts); the
            size of the slices written to other filesystems.
        max_concurrency: parts (or read ranges) of one file in flight at once on S3. One
            ``write_file`` call holds at most ``(max_concurrency + 1) * part_size`` bytes.
        retry: retry policy for transient failures.

    Raises:
        ValueError: for a bad option, a URL with no protocol, or an unknown protocol.
        ImportError: if the protocol's fsspec implementation (e.g. s3fs) is not installed.

    Example:
        >>> store = FsspecStorage("memory://ckpt")
        >>> store.write_file("data/0-0.safetensors", [b"tile"])
        >>> store.write_atomic("manifest.json", b"{}")
        >>> store.list()
        ['data/0-0.safetensors', 'manifest.json']
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, object] | None = None,
        *,
        part_size: int = 16 * MiB,
        max_concurrency: int = 4,
        retry: RetryOptions | None = None,
    ) -> None:
        import fsspec

        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if part_size < 1:
            raise ValueError(f"part_size must be >= 1, got {part_size}")
        protocol, _ = fsspec.core.split_protocol(url)
        if protocol is None:
            raise ValueError(f"{url!r} has no protocol; use FileStorage for local paths")
        self.url = url
        self.protocol: str = protocol
        self.part_size = int(part_size)
        self.max_concurrency = int(max_concurrency)
        self.retry = retry or RetryOptions()
        options = dict(storage_options or {})
        self._options = dict(options)
        self._s3: S3Objects | None = None
        if protocol in ("s3", "s3a"):
            self.fs = s3_filesystem(options)
            root = self.fs._strip_protocol(url).strip("/")
            bucket, _, prefix = root.partition("/")
            if not bucket:
                raise ValueError(f"{url!r} names no bucket")
            client_kwargs = options.get("client_kwargs") or {}
            endpoint = client_kwargs.get("endpoint_url") if isinstance(client_kwargs, Mapping) else None
            self._s3 = S3Objects(
                url,
                self.fs,
                bucket,
                prefix.strip("/"),
                part_size=self.part_size,
                max_concurrency=self.max_concurrency,
                retry=self.retry,
                endpoint=endpoint or options.get("endpoint_url"),  # type: ignore[arg-type]
            )
        else:
            try:
                self.fs, _ = fsspec.core.url_to_fs(url, **options)
            except ValueError as e:
                raise ValueError(f"no fsspec filesystem for {url!r}: {e}") from e
            root = self.fs._strip_protocol(url)
        self._root = root if root in ("", "/") else root.rstrip("/")
        self._object_store = protocol in _OBJECT_STORE_PROTOCOLS

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def reopen(self, url: str) -> FsspecStorage:
        """:class:`~tessera.storage.base.Reopens`: the same filesystem options, part size and retries at ``url``."""
        return FsspecStorage(
            url, self._options, part_size=self.part_size, max_concurrency=self.max_concurrency, retry=self.retry
        )

    # -- Storage protocol --------------------------------------------------------------------------

    def write_file(self, path: str, chunks: Iterable[Buffer]) -> None:
        """Create or replace ``path`` with the concatenated ``chunks``.

        Raises:
            StorageError: on persistent failure (after retries); nothing is left at ``path``
                on S3, a partial file may be left elsewhere.
        """
        rel = check_relpath(path)
        if self._s3 is not None:
            self._s3.write_file(rel, chunks)
            return
        full = self._full(rel)
        if isinstance(chunks, (list, tuple)):
            self._retry("writing", rel, lambda: self._generic_write(full, chunks))
            return
        try:
            self._generic_write(full, chunks)
        except Exception as e:
            raise failure("writing", self._url_of(rel), e, 1) from e

    def write_atomic(self, path: str, data: bytes) -> None:
        """Publish ``data`` at ``path`` all-or-nothing (one PUT on object stores, a rename elsewhere)."""
        rel = check_relpath(path)
        data = bytes(data)
        if self._s3 is not None:
            self._s3.put(rel, data)
            return
        full = self._full(rel)
        if self._object_store:
            self._retry("committing", rel, lambda: self.fs.pipe_file(full, data))
            return
        tmp = temp_name(full)

        def publish() -> None:
            self.fs.makedirs(self.fs._parent(full), exist_ok=True)
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, full)

        try:
            self._retry("committing", rel, publish)
        finally:
            try:
                if self.fs.exists(tmp):
                    self.fs.rm_file(tmp)
            except Exception:  # best effort: a leftover temporary file is harmless
                logger.debug("could not remove %s", tmp, exc_info=True)

    def version(self, path: str) -> str | None:
        """A token of ``path``'s current content (S3: its ETag; elsewhere size, mtime, ETag); None if absent."""
        rel = check_relpath(path)
        if self._s3 is not None:
            return self._s3.version(rel)
        full = self._full(rel)

        def info() -> str | None:
            self.fs.invalidate_cache(full)
            try:
                i = self.fs.info(full)
            except FileNotFoundError:
                return None
            keys = ("size", "ETag", "etag", "mtime", "LastModified", "created", "generation", "md5Hash")
            return "|".join(str(i.get(k)) for k in keys)

        return self._retry("stat of", rel, info)

    def replace_if(self, path: str, data: bytes, expected: str | None, *, owner: str | None = None) -> None:
        """Publish ``data`` at ``path`` only if :meth:`version` is still ``expected`` (and, with
        ``owner``, only while that file, the save's owner marker, exists).

        On S3 this is one conditional PUT (``If-Match`` / ``If-None-Match``): the store fences
        concurrent writers; ``owner`` is checked right after it, and the manifest withdrawn
        if the marker is gone (see :meth:`uncommit`). On other fsspec protocols the version
        and ``owner`` are checked right before :meth:`write_atomic`, which narrows the window
        but cannot close it.

        Raises:
            ConcurrentSaveError: if ``path`` changed since ``expected`` was read, or ``owner``
                is gone (another job's retention removed this unfinished save).
        """
        rel = check_relpath(path)
        if self._s3 is not None:
            self._s3.put_if(rel, bytes(data), expected, None if owner is None else check_relpath(owner))
            return
        if self.version(rel) != expected:
            raise ConcurrentSaveError(
                f"not committing {self._url_of(rel)}: another save committed it while this one ran; "
                "two jobs are saving to one path. The other save's checkpoint stands"
            )
        if owner is not None and not self.exists(owner):
            raise ConcurrentSaveError(
                f"not committing {self._url_of(rel)}: this save's owner marker {owner} was removed while it ran "
                "(another job's CheckpointManager deleted this unfinished checkpoint); nothing was committed"
            )
        self.write_atomic(rel, data)

    def uncommit(self, manifest: str, expected: str | None, markers: Iterable[str]) -> bool:
        """Start deleting the checkpoint of ``manifest`` (retention): if its :meth:`version` is
        still ``expected`` (None: still absent), delete the owner ``markers`` of the saves found
        there, then the manifest, and return True; False if a save committed it meanwhile.

        On S3 a save that publishes concurrently either stands (and False is returned) or
        withdraws its manifest itself; the manifest's delete is conditional on ``expected``.
        On other protocols each step is checked right before the next one (a narrow window).
        """
        rel = check_relpath(manifest)
        doomed = [check_relpath(m) for m in markers]
        if self._s3 is not None:
            return self._s3.uncommit(rel, expected, doomed)
        if self.version(rel) != expected:
            return False
        self.delete(doomed)
        if self.version(rel) != expected:
            return False
        if expected is not None:
            self.delete([rel])
        return True

    def file_sizes(self, prefix: str) -> dict[str, int]:
        """``{relative path: size}`` of every file under ``prefix`` (one listing, paginated on S3)."""
        rel_prefix = check_relpath(prefix) if prefix else ""
        if self._s3 is not None:
            return self._s3.file_sizes(rel_prefix)
        base = self._full(rel_prefix) if rel_prefix else self._root

        def find() -> dict[str, int]:
            self.fs.invalidate_cache(base)
            try:
                found = self.fs.find(base, withdirs=False, detail=True)
            except FileNotFoundError:
                return {}
            return {n.rstrip("/"): int(i.get("size") or 0) for n, i in found.items()}

        strip = self._root.rstrip("/") + "/"
        found = self._retry("listing", rel_prefix, find)
        return {n[len(strip) :]: size for n, size in found.items() if n.startswith(strip)}

    def sync_dirs(self, paths: Iterable[str]) -> None:
        """Nothing to do: an fsspec store's completed write is as durable as it gets."""

    def location(self) -> str:
        """Where this backend stores, as one comparable string."""
        return f"{self.protocol}://{self._root.lstrip('/')}"

    def read_file(self, path: str) -> bytes:
        """The whole content of ``path``.

        Raises:
            FileNotFoundError: if it does not exist.
            StorageError: on persistent failure.
        """
        rel = check_relpath(path)
        if self._s3 is not None:
            return self._s3.read_file(rel)
        full = self._full(rel)
        return self._retry("reading", rel, lambda: self.fs.cat_file(full))

    def read_bounded(self, path: str, limit: int) -> bytes | int:
        """``ReadsBounded``: one ranged GET on S3; elsewhere its size first (a ranged read of
        ``limit + 1`` bytes may allocate them all, as fsspec's local files do)."""
        if self._s3 is not None:
            return self._s3.read_bounded(check_relpath(path), limit)
        size = self.size(path)
        return size if size > limit else self.read_file(path)  # the caller checks the bytes read again

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``path``.

        Raises:
            StorageError: if the file ends before the range does, or on persistent failure.
            FileNotFoundError: if ``path`` does not exist.
        """
        rel = check_relpath(path)
        if offset < 0:
            raise ValueError(f"negative offset {offset} reading {self._url_of(rel)}")
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if not len(view):
            return
        try:
            if self._s3 is not None:
                self._s3.read_into(rel, offset, view)
            else:
                self._generic_read_into(rel, offset, view)
        except Truncated as t:
            raise StorageError(
                f"{self._url_of(rel)} is truncated: wanted bytes [{offset}, {offset + len(view)}), file ends at {t.end}"
            ) from None

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes (``FileNotFoundError`` if missing)."""
        rel = check_relpath(path)
        if self._s3 is not None:
            return self._s3.size(rel)
        full = self._full(rel)

        def stat() -> int:
            self.fs.invalidate_cache(full)
            return int(self.fs.size(full))

        return self._retry("stat of", rel, stat)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists, as a file or as a directory (prefix) with files under it."""
        rel = check_relpath(path)
        if self._s3 is not None:
            return self._s3.exists(rel)
        full = self._full(rel)

        def probe() -> bool:
            self.fs.invalidate_cache(full)
            return bool(self.fs.exists(full))

        return self._retry("checking", rel, probe)

    def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all files under ``prefix`` (recursively), sorted."""
        rel_prefix = check_relpath(prefix) if prefix else ""
        if self._s3 is not None:
            return self._s3.list(rel_prefix)
        base = self._full(rel_prefix) if rel_prefix else self._root

        def find() -> list[str]:
            self.fs.invalidate_cache(base)
            try:
                return list(self.fs.find(base, withdirs=False))
            except FileNotFoundError:
                return []

        strip = self._root.rstrip("/") + "/"
        found = {n.rstrip("/") for n in self._retry("listing", rel_prefix, find)}
        return sorted(n[len(strip) :] for n in found if n.startswith(strip))

    def delete(self, paths: Iterable[str]) -> None:
        """Remove ``paths``; missing ones are ignored."""
        rels = [check_relpath(p) for p in paths]
        if not rels:
            return
        if self._s3 is not None:
            self._s3.delete(rels)
            return
        for rel in rels:
            self._retry("deleting", rel, functools.partial(self._rm_if_present, self._full(rel)))

    # -- generic fsspec implementation --------------------------------------------------------------

    def _full(self, rel: str) -> str:
        return f"{self._root}{rel}" if self._root in ("", "/") else f"{self._root}/{rel}"

    def _url_of(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def _retry(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        return call_with_retry(self.retry, what, self._url_of(rel), fn)

    def _rm_if_present(self, full: str) -> None:
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass

    def _slices(self, chunks: Iterable[Buffer]) -> Iterator[memoryview]:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, len(view), self.part_size):
                yield view[start : start + self.part_size]

    def _generic_write(self, full: str, chunks: Iterable[Buffer]) -> None:
        if not self._object_store:
            self.fs.makedirs(self.fs._parent(full), exist_ok=True)
        f = self.fs.open(full, "wb", block_size=max(self.part_size, 5 * MiB))
        try:
            for piece in self._slices(chunks):
                f.write(piece)
        except BaseException:
            # Do not let close() publish a partial file on stores that commit on close.
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()
            else:
                f.close()
                try:
                    self._rm_if_present(full)
                except Exception:
                    logger.debug("could not remove partial %s", full, exc_info=True)
            raise
        f.close()

    def _generic_read_into(self, rel: str, offset: int, view: memoryview) -> None:
        full = self._full(rel)
        for start in range(0, len(view), self.part_size):
            piece = view[start : start + self.part_size]
            lo, hi = offset + start, offset + start + len(piece)
            data = self._retry("reading", rel, functools.partial(self.fs.cat_file, full, lo, hi))
            if len(data) < len(piece):
                raise Truncated(lo + len(data))
            piece[:] = data

"""The S3 side of :class:`~tessera.storage.FsspecStorage`: requests straight to the S3 API.

s3fs supplies the configured aiobotocore client and its event loop; the requests themselves
are made here, so that uploads are multipart with bounded memory, the commit is one PUT,
reads are ranged GETs streamed into the caller's buffer, and every request goes through one
retry policy (:mod:`tessera.storage._retry`) instead of three stacked ones.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import functools
import hashlib
import logging
import time
from collections import deque
from collections.abc import Iterable

from ..errors import ConcurrentSaveError, StorageError
from ._retry import Truncated, describe, error_code
from ._s3_requests import S3_MAX_PARTS, MiB, S3Requests
from ._s3_requests import s3_filesystem as s3_filesystem
from .base import Buffer

logger = logging.getLogger(__name__)

_PARTS_PER_SIZE = 2_000  # the part size doubles every this many parts: 62,000 x part_size max
_DELETE_BATCH = 1_000  # DeleteObjects' limit
_STREAM_READ = 4 * MiB


def _multipart_etag(parts: list[dict[str, object]]) -> str | None:
    """The ETag S3 gives the object made of ``parts``: MD5 of the parts' MD5s, "-", count.

    ``None`` where part ETags are not MD5s (e.g. SSE-KMS), so no match is ever claimed.
    """
    try:
        ordered = sorted(parts, key=lambda p: p["PartNumber"])  # type: ignore[arg-type,return-value]
        digests = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in ordered)
    except ValueError:
        return None
    return f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"'


class S3Objects(S3Requests):
    """Objects under ``s3://<bucket>/<prefix>/``: uploads, the conditional commit, reads, listings.

    Constructed like :class:`~tessera.storage._s3_requests.S3Requests` (url, fs, bucket, prefix,
    part_size, max_concurrency, retry, endpoint).
    """

    # -- operations --------------------------------------------------------------------------------

    def write_file(self, rel: str, chunks: Iterable[Buffer]) -> None:
        """Stream ``chunks`` into one object: a PUT if under one part, else a multipart upload.

        The chunks are copied into part buffers (at most ``max_concurrency + 1`` of them), so
        no reference to them outlives the call. A failed upload is aborted, never completed.
        """
        key = self._key(rel)
        free: list[bytearray] = []
        inflight: deque[tuple[int, concurrent.futures.Future[dict], bytearray]] = deque()
        parts: list[dict[str, object]] = []
        upload_id: str | None = None
        part_number = 0
        buf: bytearray | None = None
        filled = 0
        total = 0

        def part_size(number: int) -> int:
            # Doubling every 2,000 parts keeps files of up to 62,000 x part_size under S3's
            # 10,000-part limit without asking users to size parts for their largest file.
            return self.part_size << ((number - 1) // _PARTS_PER_SIZE)

        def take_buffer() -> bytearray:
            size = part_size(part_number + 1)
            while free:
                b = free.pop()
                if len(b) == size:
                    return b
            return bytearray(size)

        def reap_oldest() -> None:
            number, fut, used = inflight.popleft()
            resp = fut.result()  # the part's final outcome, after its retries
            entry: dict[str, object] = {"PartNumber": number, "ETag": resp["ETag"]}
            if "ChecksumSHA256" in resp:
                entry["ChecksumSHA256"] = resp["ChecksumSHA256"]
            parts.append(entry)
            free.append(used)

        def submit(full: bytearray, length: int) -> None:
            nonlocal upload_id, part_number
            if upload_id is None:
                upload_id = self._request("starting upload of", rel, "create_multipart_upload", Key=key)["UploadId"]
            part_number += 1
            if part_number > S3_MAX_PARTS:
                raise StorageError(
                    f"writing {self.url_of(rel)}: the file needs more than {S3_MAX_PARTS} parts; raise part_size"
                )
            body = full if length == len(full) else bytes(memoryview(full)[:length])
            number, uid = part_number, upload_id

            async def upload() -> dict:
                return await self._retrying(
                    f"uploading part {number} of",
                    rel,
                    lambda: self._call("upload_part", Key=key, UploadId=uid, PartNumber=number, Body=body),
                )

            while len(inflight) >= self.max_concurrency:
                reap_oldest()
            inflight.append((number, asyncio.run_coroutine_threadsafe(upload(), self.fs.loop), full))

        t0 = time.monotonic()
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                pos = 0
                while pos < len(view):
                    if buf is None:
                        buf, filled = take_buffer(), 0
                    k = min(len(view) - pos, len(buf) - filled)
                    buf[filled : filled + k] = view[pos : pos + k]
                    filled += k
                    pos += k
                    if filled == len(buf):
                        submit(buf, filled)
                        buf = None
                total += len(view)
            if upload_id is None:
                # Smaller than one part: one PUT, one request instead of three.
                body = bytes(memoryview(buf)[:filled]) if buf is not None else b""
                self._request("writing", rel, "put_object", Key=key, Body=body)
            else:
                if buf is not None and filled:
                    submit(buf, filled)
                    buf = None
                while inflight:
                    reap_oldest()
                self._complete(rel, key, upload_id, parts, total)
        except BaseException:
            for _, fut, _ in inflight:
                fut.cancel()
            concurrent.futures.wait([fut for _, fut, _ in inflight], timeout=60)
            if upload_id is not None:
                self._abort(rel, key, upload_id)
            raise
        logger.debug(
            "wrote %s: %d bytes, %d part(s), %.3fs", self.url_of(rel), total, max(part_number, 1), time.monotonic() - t0
        )

    def _complete(self, rel: str, key: str, upload_id: str, parts: list[dict[str, object]], total: int) -> None:
        done = {"Parts": sorted(parts, key=lambda p: p["PartNumber"])}  # type: ignore[arg-type,return-value]
        try:
            self._request(
                "completing upload of",
                rel,
                "complete_multipart_upload",
                Key=key,
                UploadId=upload_id,
                MultipartUpload=done,
            )
        except StorageError as e:
            # A retried Complete whose first try succeeded (the answer was lost) finds the
            # upload gone. If the object now carries this upload's ETag, that is success.
            if error_code(e)[0] != "NoSuchUpload":
                raise
            try:
                head = self._request("checking", rel, "head_object", Key=key)
            except (FileNotFoundError, StorageError):
                raise e from None
            if int(head["ContentLength"]) != total or head.get("ETag") != _multipart_etag(parts):
                raise
            logger.info("upload of %s completed by an earlier attempt whose answer was lost", self.url_of(rel))

    def _abort(self, rel: str, key: str, upload_id: str) -> None:
        try:
            self._request("aborting upload of", rel, "abort_multipart_upload", Key=key, UploadId=upload_id)
        except Exception as e:
            # The bucket's lifecycle rules clean up abandoned uploads; the write failed anyway.
            logger.warning("could not abort the multipart upload of %s: %s", self.url_of(rel), e)

    def put(self, rel: str, data: bytes) -> None:
        """One PUT of ``data``: readers see the old object or the new one."""
        self._request("committing", rel, "put_object", Key=self._key(rel), Body=data)

    def version(self, rel: str) -> str | None:
        """The object's ETag (None if it does not exist): one HEAD."""
        try:
            return str(self._request("stat of", rel, "head_object", Key=self._key(rel))["ETag"])
        except FileNotFoundError:
            return None

    def put_if(self, rel: str, data: bytes, expected: str | None, owner: str | None = None) -> None:
        """A conditional PUT: ``If-Match: <expected>``, or ``If-None-Match: *`` for a new object.

        The store itself compares and writes in one step, so two writers can never both
        succeed from the same ``expected``. If an attempt's answer was lost and its retry is
        refused, the object is checked: if it holds exactly ``data`` (its MD5 ETag), the PUT
        had succeeded.

        With ``owner`` (a save's owner marker), the marker is checked right *after* the PUT,
        and the object is withdrawn again (a delete conditional on its ETag) if the marker is
        gone. S3 cannot make one request conditional on another object, so the two sides
        order their steps instead: retention (:meth:`uncommit`) deletes the markers and then
        looks at the manifest; a save puts the manifest and then looks at its marker. At
        least one of them sees the other: either the save stands and retention keeps the
        step, or the save withdraws its manifest and fails (a manifest naming files
        retention deleted may be visible for the few milliseconds in between).

        Raises:
            ConcurrentSaveError: if the object is no longer ``expected`` (replaced, or deleted
                by retention), or ``owner`` was removed (nothing stays published then).
            StorageError: if the manifest could not be withdrawn after ``owner`` was found gone.
        """
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        mine = f'"{hashlib.md5(data).hexdigest()}"'
        try:
            resp = self._request("committing", rel, "put_object", Key=self._key(rel), Body=data, **condition)
            etag = str(resp.get("ETag") or mine)
        except FileNotFoundError as e:  # If-Match on an object deleted meanwhile: 404, not 412
            raise ConcurrentSaveError(
                f"not committing {self.url_of(rel)}: the manifest this save started from was deleted while it "
                "ran (retention of another job, or another tool, removed this checkpoint); nothing was committed"
            ) from e
        except StorageError as e:
            code, status = error_code(e)
            if code not in ("PreconditionFailed", "ConditionalRequestConflict") and status not in (409, 412):
                raise
            if self.version(rel) != mine:
                raise ConcurrentSaveError(
                    f"not committing {self.url_of(rel)}: another save committed it while this one ran "
                    f"(the conditional PUT was refused: {describe(e)}); two jobs are saving to one path. "
                    "The other save's checkpoint stands"
                ) from e
            etag = mine  # our own earlier attempt landed
        if owner is None or self._has_object(owner):
            return
        try:
            self.delete_if(rel, etag)
        except Exception as e:
            raise StorageError(
                f"{self.url_of(rel)}: this save's owner marker {owner} was removed while it committed (another "
                f"job's retention deleted this unfinished checkpoint), and withdrawing its manifest failed: {e}. "
                "The checkpoint may name deleted files: delete it"
            ) from e
        raise ConcurrentSaveError(
            f"not committing {self.url_of(rel)}: this save's owner marker {owner} was removed while it ran "
            "(another job's CheckpointManager deleted this unfinished checkpoint as a leftover, with some of its "
            "files); two jobs are saving under one root. Nothing was committed"
        )

    def _has_object(self, rel: str) -> bool:
        """Whether the object ``rel`` exists (one HEAD; a prefix with objects under it does not count)."""
        try:
            self._request("checking", rel, "head_object", Key=self._key(rel))
        except FileNotFoundError:
            return False
        return True

    def delete_if(self, rel: str, expected: str) -> bool:
        """Delete ``rel`` only if its ETag is ``expected`` (``If-Match``). Returns False if it is
        another object now; True if it was deleted or was already gone.

        On a store that ignores ``If-Match`` on deletes, the delete is unconditional.
        """
        try:
            self._request("deleting", rel, "delete_object", Key=self._key(rel), IfMatch=expected)
        except FileNotFoundError:
            return True
        except StorageError as e:
            code, status = error_code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise
        return True

    def uncommit(self, rel: str, expected: str | None, markers: Iterable[str]) -> bool:
        """Retention's first step on S3: withdraw the manifest ``rel`` if it is still ``expected``.

        The owner ``markers`` go first, then the manifest is looked at again (a delete
        conditional on ``expected``, or a HEAD when it was absent): a save that published in
        between either saw its marker before it went (its manifest then stands, and False is
        returned) or sees it gone and withdraws its own manifest (:meth:`put_if`).

        Returns:
            True if the step is uncommitted and no save listed in ``markers`` can publish any
            more (its data may be deleted); False, having deleted only markers, if a save
            committed ``rel`` since ``expected`` was read.
        """
        if self.version(rel) != expected:
            return False
        doomed = list(markers)
        if doomed:
            self.delete(doomed)
        if expected is None:
            return self.version(rel) is None
        return self.delete_if(rel, expected)

    def file_sizes(self, rel_prefix: str) -> dict[str, int]:
        """``{relative path: size}`` under ``rel_prefix``: one LIST request per 1,000 objects."""
        return dict(self._run(self._list_sized, rel_prefix))

    def read_file(self, rel: str) -> bytes:
        key = self._key(rel)

        async def get() -> bytes:
            resp = await self._call("get_object", Key=key)
            body = resp["Body"]
            try:
                return await body.read()
            finally:
                body.close()

        return self._run(self._retrying, "reading", rel, get)

    def read_bounded(self, rel: str, limit: int) -> bytes | int:
        """One ranged GET of the first ``limit + 1`` bytes; the object's size from its
        ``Content-Range`` when it is longer (see ``ReadsBounded``)."""
        key = self._key(rel)

        async def get() -> bytes | int:
            try:
                resp = await self._call("get_object", Key=key, Range=f"bytes=0-{limit}")
            except Exception as e:
                if error_code(e)[0] == "InvalidRange":  # an empty object: no byte 0
                    return b""
                raise
            body = resp["Body"]
            try:
                total = str(resp.get("ContentRange", "")).rpartition("/")[2]
                if total.isdigit() and int(total) > limit:
                    return int(total)  # refused from its size: the body is not read
                data = await body.read()
            finally:
                body.close()
            return len(data) if len(data) > limit else data

        return self._run(self._retrying, "reading", rel, get)

    def read_into(self, rel: str, offset: int, view: memoryview) -> None:
        """Ranged GETs of ``part_size`` bytes, ``max_concurrency`` at a time, into ``view``.

        Raises:
            Truncated: if the object ends before the range does.
        """
        self._run(self._read_into, rel, offset, view)

    async def _read_into(self, rel: str, offset: int, view: memoryview) -> None:
        key = self._key(rel)
        sem = asyncio.Semaphore(self.max_concurrency)

        async def fetch(start: int, piece: memoryview) -> None:
            lo, hi = offset + start, offset + start + len(piece) - 1

            async def once() -> None:
                try:
                    resp = await self._call("get_object", Key=key, Range=f"bytes={lo}-{hi}")
                except Exception as e:
                    if error_code(e)[0] == "InvalidRange":  # the range starts at or past the end
                        head = await self._call("head_object", Key=key)
                        raise Truncated(int(head["ContentLength"])) from e
                    raise
                body = resp["Body"]
                got = 0
                try:
                    while got < len(piece):
                        data = await body.read(min(len(piece) - got, _STREAM_READ))
                        if not data:
                            break
                        piece[got : got + len(data)] = data
                        got += len(data)
                finally:
                    body.close()
                if got < len(piece):
                    raise Truncated(lo + got)

            async with sem:
                await self._retrying("reading", rel, once)

        pieces = [(s, view[s : s + self.part_size]) for s in range(0, len(view), self.part_size)]
        # Wait for every range (no write into ``view`` may outlive the call), then report.
        results = await asyncio.gather(*(fetch(s, p) for s, p in pieces), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def size(self, rel: str) -> int:
        return int(self._request("stat of", rel, "head_object", Key=self._key(rel))["ContentLength"])

    def exists(self, rel: str) -> bool:
        key = self._key(rel)

        async def probe() -> bool:
            try:
                await self._call("head_object", Key=key)
                return True
            except FileNotFoundError:
                pass  # not an object; maybe a "directory" (a missing bucket fails the listing)
            resp = await self._call("list_objects_v2", Prefix=key + "/", MaxKeys=1)
            return bool(resp.get("KeyCount") or resp.get("Contents"))

        return self._run(self._retrying, "checking", rel, probe)

    def list(self, rel_prefix: str) -> list[str]:
        return [name for name, _ in self._run(self._list_sized, rel_prefix)]

    async def _list_sized(self, rel_prefix: str) -> builtins.list[tuple[str, int]]:
        base = self._key(rel_prefix) if rel_prefix else self.prefix
        list_prefix = base if rel_prefix else (f"{base}/" if base else "")
        strip = f"{self.prefix}/" if self.prefix else ""
        out: builtins.list[tuple[str, int]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, object] = {"Prefix": list_prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = await self._retrying(
                "listing", rel_prefix, functools.partial(self._call, "list_objects_v2", **kwargs)
            )
            for obj in resp.get("Contents", []):
                name = obj["Key"]
                if name.endswith("/"):
                    continue  # "directory" placeholder objects made by some tools
                if rel_prefix and not (name == base or name.startswith(base + "/")):
                    continue  # "data2/x" is not under "data"
                out.append((name[len(strip) :], int(obj.get("Size", 0))))
            if not resp.get("IsTruncated"):
                return sorted(out)
            token = resp.get("NextContinuationToken")

    def delete(self, rels: builtins.list[str]) -> None:
        for i in range(0, len(rels), _DELETE_BATCH):
            batch = rels[i : i + _DELETE_BATCH]
            objects = [{"Key": self._key(r)} for r in batch]
            resp = self._request("deleting", batch[0], "delete_objects", Delete={"Objects": objects, "Quiet": True})
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                detail = "; ".join(f"{e.get('Key')}: {e.get('Code')} {e.get('Message', '')}" for e in errors[:5])
                raise StorageError(
                    f"deleting {len(errors)} of {len(batch)} objects under {self.url} failed: {detail}"
                    f"{' ...' if len(errors) > 5 else ''}; check that the bucket policy allows s3:DeleteObject"
                )

"""The S3 remote: the same CAS + action-cache layout as the local store, under `s3://bucket/prefix`.

    <prefix>/cas/ab/<blake3>       immutable blobs
    <prefix>/ac/ab/<key>.json      manifests (the same JSON as the local store), written last and only if absent
    <prefix>/<side cache>/         small index objects of a backend's side cache (qbuild.store.side_cache), e.g.
                                   neuron-compile-cache/ (qbuild.backends.neuron.compile_cache)

boto3 is imported when a remote is first used, never on the planning path of a build without one. Credentials come
from boto3's standard chain; `QBUILD_S3_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`) points at an
S3-compatible server. Every failure becomes one InfraError line naming the object, with credentials scrubbed.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlsplit

from qbuild.core.errors import InfraError, UserError
from qbuild.core.threads import map_all
from qbuild.store.manifest import Manifest

MULTIPART_THRESHOLD = 64 << 20      # files above this go up and down in parallel parts
MULTIPART_CHUNK = 32 << 20
TRANSFER_THREADS = 8                 # parts of one file in flight
POOL_THREADS = 16                    # HEADs / small objects in flight
DELETE_BATCH = 1000                  # the most keys one DeleteObjects call takes
# A remote that accepts connections and never answers fails in about ATTEMPTS * READ_TIMEOUT_S (~15 s), not
# botocore's 4 x 60 s. S3 sends its first byte within a second, CompleteMultipartUpload included (it answers at once
# and keeps the connection alive while it works); retries back off by a fraction of a second for errors other
# than throttling.
CONNECT_TIMEOUT_S = 4
READ_TIMEOUT_S = 5
ATTEMPTS = 3                         # per request, the first included
DOWNLOAD_ATTEMPTS = 2                # a blob download whose stream breaks is started again once

Callback = Callable[[int], None]


@dataclass(frozen=True)
class RemoteObject:
    name: str                         # digest (cas/) or key (ac/)
    size: int
    modified: datetime


# S3's bucket naming rules (S3-compatible servers follow them too), checked up front so that a typo is one exit-2
# line naming the value instead of a remote error once work has started.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")


def parse_remote(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix"); anything else is a UserError naming the value."""
    try:
        parts = urlsplit(url)
    except ValueError:   # e.g. an unbalanced "[" in the host
        parts = None
    if parts is None or parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise UserError(f"remote: {url!r} is not an s3://bucket/prefix URL")
    bucket = parts.netloc
    if "@" in bucket:   # never echo it: the part before "@" would be a credential
        raise UserError("remote: the URL carries credentials (user@ or user:password@); remove them and use the AWS "
                        "credential chain (AWS_PROFILE, environment, role)")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP_ADDRESS.fullmatch(bucket):
        raise UserError(f"remote: {url!r}: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                        "dots and hyphens, starting and ending with a letter or digit)")
    return bucket, parts.path.strip("/")


def endpoint_url() -> str | None:
    for var in ("QBUILD_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return os.environ[var]
    return None


class S3Remote:
    """One bucket/prefix. Thread-safe: boto3 clients may be shared between threads (sessions may not)."""

    def __init__(self, url: str, *, probe: bool = False):
        """With `probe`, the first 404 this remote answers is checked against the bucket itself (HeadBucket): an
        endpoint that answers 404 to everything, or a missing bucket, must not look like an empty remote. A command
        probes in its own process; the workers it starts do not."""
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_remote(url)
        self._probe = probe
        self._probe_lock = threading.Lock()
        self._client = None
        self._session = None
        self._init_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Remote({self.url})"

    # --- names ---------------------------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def blob_key(self, digest: str) -> str:
        return self._key("cas", digest[:2], digest)

    def manifest_key(self, key: str) -> str:
        return self._key("ac", key[:2], f"{key}.json")

    def object_url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # --- the client ----------------------------------------------------------------------------------------------
    @property
    def client(self):
        with self._init_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                endpoint = endpoint_url()
                config = Config(retries={"total_max_attempts": ATTEMPTS, "mode": "standard"},
                                connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                                max_pool_connections=POOL_THREADS + TRANSFER_THREADS,
                                s3={"addressing_style": "path"} if endpoint else None)
                self._session = boto3.session.Session()
                try:
                    self._client = self._session.client("s3", endpoint_url=endpoint, config=config)
                except Exception as e:  # a bad region or endpoint in the environment
                    raise self.error(e, self.object_url(self._key()))
            return self._client

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK,
                              max_concurrency=TRANSFER_THREADS, num_download_attempts=DOWNLOAD_ATTEMPTS)

    def _check_bucket(self, where: str) -> None:
        """Called on a 404 that would mean "absent": raise unless the bucket exists at this endpoint (asked once)."""
        with self._probe_lock:
            if not self._probe:
                return
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except Exception as e:
                if _status(e) == 404 or _code(e) == "NoSuchBucket":
                    raise InfraError(f"{where}: no such bucket {self.bucket} at {_endpoint_host()} (HeadBucket "
                                     "answered 404): the bucket does not exist or the endpoint is not its S3 server; "
                                     "check the --remote URL and QBUILD_S3_ENDPOINT_URL") from None
                # Anything else (403 without s3:ListBucket, a redirect) says the bucket is there, or is left to the
                # next request, whose error names what it was after.
            self._probe = False

    # --- manifests -----------------------------------------------------------------------------------------------
    def get_manifest(self, key: str) -> Manifest | None:
        name = self.manifest_key(key)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        except Exception as e:
            if _status(e) == 404 and _code(e) != "NoSuchBucket":
                self._check_bucket(self.object_url(name))
                return None
            raise self.error(e, self.object_url(name)) from None
        try:
            manifest = Manifest.from_json(json.loads(body))
        except (ValueError, KeyError, TypeError) as e:
            raise InfraError(f"{self.object_url(name)}: unreadable manifest ({type(e).__name__}); "
                             "delete it or run `qbuild gc --remote`") from None
        return manifest

    def put_manifest(self, manifest: Manifest) -> bool:
        """Write a manifest unless one exists (If-None-Match: *). True if this call wrote it."""
        name = self.manifest_key(manifest.key)
        try:
            self.client.put_object(Bucket=self.bucket, Key=name, Body=manifest.to_bytes(), IfNoneMatch="*",
                                   ContentType="application/json")
        except Exception as e:
            if _status(e) == 412 or _code(e) in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False  # another writer got there first; manifests of one key are equal by construction
            if _status(e) == 501 or _code(e) == "NotImplemented":
                return self._put_if_absent_without_condition(name, manifest)
            raise self.error(e, self.object_url(name)) from None
        return True

    def _put_if_absent_without_condition(self, name: str, manifest: Manifest) -> bool:
        """For S3-compatible servers without conditional writes: check, then put (a race only rewrites equal bytes:
        a manifest is a function of its key's build, and its blobs are already in place)."""
        if self._present({name: name}):
            return False
        try:
            self.client.put_object(Bucket=self.bucket, Key=name, Body=manifest.to_bytes(),
                                   ContentType="application/json")
        except Exception as e:
            raise self.error(e, self.object_url(name)) from None
        return True

    def has_manifests(self, keys: Iterable[str]) -> set[str]:
        return self._present({k: self.manifest_key(k) for k in keys})

    # --- blobs ---------------------------------------------------------------------------------------------------
    def has_blobs(self, digests: Iterable[str]) -> set[str]:
        """The subset of `digests` the remote holds, checked with HEADs in a thread pool."""
        return self._present({d: self.blob_key(d) for d in digests})

    def blob_sizes(self, digests: Iterable[str]) -> dict[str, int]:
        """The size of each of `digests` the remote holds (those it lacks are absent), from HEADs in a thread pool."""
        return self._heads({d: self.blob_key(d) for d in digests})

    def upload_blob(self, path: Path, digest: str, callback: Callback | None = None) -> None:
        name = self.blob_key(digest)
        try:
            self.client.upload_file(str(path), self.bucket, name, Config=self._transfer_config(), Callback=callback)
        except Exception as e:
            raise self.error(e, self.object_url(name)) from None

    def download_blob(self, digest: str, dest: Path, callback: Callback | None = None) -> None:
        name = self.blob_key(digest)
        try:
            self.client.download_file(self.bucket, name, str(dest), Config=self._transfer_config(),
                                      Callback=callback)
        except Exception as e:
            if _status(e) == 404:
                self._check_bucket(self.object_url(name))
                raise InfraError(f"{self.object_url(name)}: blob missing on the remote although a manifest names "
                                 f"it; {self.repair_hint()}") from None
            error = self.error(e, self.object_url(name))
            if _broken_stream(getattr(e, "last_exception", None) or e):
                # What came down is in s3transfer's temporary file, which it removes, in the caller's staging.
                error = InfraError(f"{error}; nothing of the blob was kept: run the command again")
            raise error from None

    def blob_digest(self, digest: str, callback: Callback | None = None) -> str | None:
        """BLAKE3 of the bytes the remote holds for blob `digest`, streamed (nothing is written locally); None when
        the remote lacks it."""
        import blake3

        name = self.blob_key(digest)
        hasher = blake3.blake3()
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=name)["Body"]
            for chunk in body.iter_chunks(1 << 20):
                hasher.update(chunk)
                if callback is not None:
                    callback(len(chunk))
        except Exception as e:
            if _status(e) == 404 and _code(e) != "NoSuchBucket":
                self._check_bucket(self.object_url(name))
                return None
            raise self.error(e, self.object_url(name)) from None
        return hasher.hexdigest()

    def repair_hint(self) -> str:
        """What to run about a blob that is missing or corrupt here: a publish that checks the remote's bytes
        re-uploads it from a store that holds it."""
        return (f"repair the remote from a machine whose store holds it: `qbuild publish --all --verify-remote "
                f"--remote {self.url}`")

    # --- small objects by name (the compile cache's index objects) ----------------------------------------------
    def object_key(self, *parts: str) -> str:
        return self._key(*parts)

    def get_object(self, name: str) -> bytes | None:
        """The bytes of object `name` (a full key), or None where there is none."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        except Exception as e:
            if _status(e) == 404 and _code(e) != "NoSuchBucket":
                self._check_bucket(self.object_url(name))
                return None
            raise self.error(e, self.object_url(name)) from None

    def put_object(self, name: str, data: bytes) -> None:
        """Write a small JSON object under its full key (an index of the compile cache, a lease)."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=name, Body=data, ContentType="application/json")
        except Exception as e:
            if _status(e) == 404:   # a missing bucket, or an endpoint answering 404 to everything
                self._check_bucket(self.object_url(name))
            raise self.error(e, self.object_url(name)) from None

    def list_objects(self, prefix: str) -> Iterator[RemoteObject]:
        """The objects whose full key starts with `prefix` (named by their full key)."""
        return self._list(prefix)

    # --- leases (qbuild.store.remote: a push and a gc never overlap) -----------------------------------------------
    def lease_key(self, name: str) -> str:
        return self._key("leases", f"{name}.json")

    def put_lease(self, name: str, body: bytes) -> None:
        self.put_object(self.lease_key(name), body)

    def get_lease(self, name: str) -> dict | None:
        """A lease's JSON body; None when it is gone (released meanwhile) or is not a JSON object."""
        key = self.lease_key(name)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as e:
            if _status(e) == 404 and _code(e) != "NoSuchBucket":
                return None
            raise self.error(e, self.object_url(key)) from None
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def delete_lease(self, name: str) -> None:
        key = self.lease_key(name)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            raise self.error(e, self.object_url(key)) from None

    def list_leases(self) -> tuple[list[RemoteObject], datetime | None]:
        """The leases (names without .json) and the server's clock at the listing (its Date header; None where it
        sends none), so that a lease's age is measured on one clock."""
        prefix = self._key("leases") + "/"
        leases, now = [], None
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
                if date and now is None:
                    from email.utils import parsedate_to_datetime

                    now = parsedate_to_datetime(date)
                for obj in page.get("Contents", []):
                    name = obj["Key"].rsplit("/", 1)[-1]
                    if name.endswith(".json"):
                        leases.append(RemoteObject(name[:-len(".json")], obj["Size"], obj["LastModified"]))
        except Exception as e:
            if _status(e) == 404:
                self._check_bucket(self.object_url(prefix))
            raise self.error(e, self.object_url(prefix)) from None
        return leases, now

    # --- listing and deleting (gc) -------------------------------------------------------------------------------
    def list_manifests(self) -> Iterator[RemoteObject]:
        for obj in self._list(self._key("ac") + "/"):
            name = obj.name.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                yield RemoteObject(name[:-len(".json")], obj.size, obj.modified)

    def list_blobs(self) -> Iterator[RemoteObject]:
        for obj in self._list(self._key("cas") + "/"):
            yield RemoteObject(obj.name.rsplit("/", 1)[-1], obj.size, obj.modified)

    def delete(self, names: list[str]) -> None:
        """Delete objects by full key, in batches."""
        for i in range(0, len(names), DELETE_BATCH):
            batch = names[i:i + DELETE_BATCH]
            try:
                out = self.client.delete_objects(Bucket=self.bucket,
                                                 Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except Exception as e:
                raise self.error(e, self.object_url(batch[0])) from None
            if out.get("Errors"):
                err = out["Errors"][0]
                raise InfraError(self._scrub(f"{self.object_url(err.get('Key', ''))}: delete failed: "
                                             f"{err.get('Code')} {err.get('Message', '')}".strip()))

    def _list(self, prefix: str) -> Iterator[RemoteObject]:
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    yield RemoteObject(obj["Key"], obj["Size"], obj["LastModified"])
        except Exception as e:
            if _status(e) == 404:
                self._check_bucket(self.object_url(prefix))
            raise self.error(e, self.object_url(prefix)) from None

    def _present(self, names: dict[str, str]) -> set[str]:
        return set(self._heads(names))

    def _heads(self, names: dict[str, str]) -> dict[str, int]:
        """{ident: the object's size} for each of `names` (ident -> full key) that exists."""
        if not names:
            return {}

        def head(item: tuple[str, str]) -> tuple[str, int] | None:
            ident, name = item
            try:
                answer = self.client.head_object(Bucket=self.bucket, Key=name)
            except Exception as e:
                if _status(e) == 404:
                    self._check_bucket(self.object_url(name))
                    return None
                raise self.error(e, self.object_url(name)) from None
            return ident, answer["ContentLength"]

        _ = self.client  # create the client once, before the threads share it
        return dict(found for found in map_all(head, sorted(names.items()), POOL_THREADS) if found is not None)

    # --- errors --------------------------------------------------------------------------------------------------
    def error(self, e: BaseException, where: str) -> InfraError:
        """One line naming `where` and what went wrong; never a credential."""
        return InfraError(self._scrub(f"{where}: {_describe(e, self.bucket)}"))

    def _scrub(self, text: str) -> str:
        secrets = {os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                               "AWS_SECURITY_TOKEN")}
        creds = self._session.get_credentials() if self._session is not None and self._client is not None else None
        if creds is not None:
            secrets |= _frozen_secrets(creds)
        for s in sorted((s for s in secrets if s and len(s) >= 4), key=len, reverse=True):
            text = text.replace(s, "***")
        return text


def _status(e: BaseException) -> int | None:
    resp = getattr(_client_error(e), "response", None) or {}
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if status is None and resp.get("Error", {}).get("Code", "").isdigit():
        status = int(resp["Error"]["Code"])
    return status


def _code(e: BaseException) -> str | None:
    resp = getattr(_client_error(e), "response", None) or {}
    return resp.get("Error", {}).get("Code")


def _client_error(e: BaseException) -> BaseException | None:
    """The botocore ClientError behind `e` (s3transfer wraps them), if any."""
    from botocore.exceptions import ClientError

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ClientError):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


_CODES = {
    "NoSuchBucket": "no such bucket {bucket} at {endpoint}",
    "AccessDenied": "access denied (the credentials need s3:GetObject, s3:PutObject, s3:ListBucket and, for gc, "
                    "s3:DeleteObject on this bucket and prefix)",
    "AllAccessDisabled": "access to bucket {bucket} is disabled",
    "InvalidAccessKeyId": "the AWS access key id was rejected; check the credential chain (AWS_PROFILE, role, env)",
    "SignatureDoesNotMatch": "the AWS secret key was rejected; check the credential chain",
    "ExpiredToken": "the AWS session token has expired; refresh the credentials",
    "InvalidToken": "the AWS session token was rejected; refresh the credentials",
    "PermanentRedirect": "bucket {bucket} is in another region; set AWS_REGION to its region",
    "AuthorizationHeaderMalformed": "bucket {bucket} is in another region; set AWS_REGION to its region",
    "SlowDown": "the server throttled us (SlowDown) beyond the retry budget; try again",
    "403": "access denied (HTTP 403): the credentials were rejected or lack s3:GetObject / s3:ListBucket here",
    "404": "not found (HTTP 404)",
}


def _describe(e: BaseException, bucket: str) -> str:
    from boto3.exceptions import RetriesExceededError
    from botocore import exceptions as bx
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceededError

    if isinstance(e, (RetriesExceededError, TransferRetriesExceededError)) and e.last_exception is not None:
        # s3transfer starts a download whose stream broke again, DOWNLOAD_ATTEMPTS times, then raises this (boto3
        # re-raises its own class) around the last failure, which says what happened.
        return f"{_describe(e.last_exception, bucket)} ({DOWNLOAD_ATTEMPTS} attempts)"
    if _broken_stream(e):
        return f"the connection to {_endpoint_host()} closed in the middle of the transfer"
    ce = _client_error(e)
    if ce is not None:
        code = _code(ce) or str(_status(ce) or "")
        if code in _CODES:
            return _CODES[code].format(bucket=bucket, endpoint=_endpoint_host())
        message = ce.response.get("Error", {}).get("Message") or ""
        return f"{code or 'error'} (HTTP {_status(ce)}){': ' + message if message else ''}"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return "no AWS credentials found (set AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use a role)"
    if isinstance(e, bx.CredentialRetrievalError):
        return "could not obtain AWS credentials from the configured provider"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ConnectTimeoutError,
                      bx.ProxyConnectionError)):
        return f"cannot connect to {_endpoint_host()} (connection refused, closed or timed out)"
    if isinstance(e, bx.ReadTimeoutError):
        return f"{_endpoint_host()} stopped answering (read timeout)"
    if isinstance(e, bx.NoRegionError):
        return "no AWS region configured; set AWS_REGION"
    if isinstance(e, bx.BotoCoreError):
        return f"{type(e).__name__}: {e}"
    if isinstance(e, OSError):
        return f"local I/O failed: {e.strerror or e}"
    return f"{type(e).__name__}: {e}"


def _broken_stream(e: BaseException) -> bool:
    """Whether `e` (or what it wraps) is a connection that closed or was reset while a body was streaming."""
    import http.client

    from botocore import exceptions as bx
    from urllib3 import exceptions as ux

    for _ in range(8):
        if e is None:
            return False
        if isinstance(e, (bx.ResponseStreamingError, bx.IncompleteReadError, ux.ProtocolError, ux.IncompleteRead,
                          http.client.IncompleteRead, ConnectionResetError, ConnectionAbortedError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _endpoint_host() -> str:
    """The endpoint without any userinfo (which could hold a secret)."""
    url = endpoint_url()
    if not url:
        return "the S3 endpoint"
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else (parts.hostname or "the S3 endpoint")


def _frozen_secrets(creds) -> set[str]:
    """The current key, secret and token; empty when refreshing them fails, so the original error still shows."""
    try:
        frozen = creds.get_frozen_credentials()
    except Exception:
        return set()
    return {frozen.access_key, frozen.secret_key, frozen.token}

"""One fsspec filesystem per URL, with the S3 endpoint pinned from the environment.

Every module that reads or writes a URL (targets, draft heads, tries, inputs, outputs, corpora)
gets its filesystem here, so they all agree on which server an s3:// URL means. fsspec caches
filesystem instances by their constructor arguments; an s3fs instance built without an explicit
endpoint reads AWS_ENDPOINT_URL once, when it is first built, and is then reused by every later
`url_to_fs` in the process even after the variable changed. Passing the endpoint explicitly makes
it part of the cache key, so a process whose endpoint changes (a test against a fresh local S3
server, a driver reconfigured between jobs) never talks to the old one.

Credentials are never handled here: s3fs builds its client with botocore's standard chain. Only
the endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, which botocore honours too) is read, because
it is not a secret and pinning it keeps the driver and every worker on the same server.

StorageError and its helpers (`filesystem_for`, `describe_error`, `redact`) live here too, so that
the job (pipeline.data.storage re-exports them) and the artifacts built below it (dart_train's teacher
cache) report storage failures alike.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_SECRET_ENV_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def s3_options(storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`storage_options` for s3fs with the environment's endpoint added unless one is given or
    AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true asks for the default one."""
    options = dict(storage_options or {})
    ignore_env = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = options.get("client_kwargs") or {}
    if endpoint and not ignore_env and "endpoint_url" not in options and "endpoint_url" not in client_kwargs:
        options["endpoint_url"] = endpoint
    return options


def url_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem serving `url` and the path of `url` inside it.

    Plain paths and file:// URLs get the local filesystem and an absolute, normalised path;
    s3:// (and s3a://) get s3fs with the endpoint pinned (see the module docstring); anything else
    goes through fsspec's registry (gs://, az://, memory://, ...). `storage_options` go to the
    filesystem's constructor. Raises ImportError / ValueError for a protocol fsspec cannot serve.
    """
    storage_options = dict(storage_options or {})
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
        return LocalFileSystem(), os.path.normpath(os.path.abspath(os.path.expanduser(path)))
    protocol = url.split("://", 1)[0].lower()
    if protocol in ("s3", "s3a"):
        import s3fs

        fs = s3fs.S3FileSystem(**s3_options(storage_options))
        return fs, fs._strip_protocol(url)
    return fsspec.core.url_to_fs(url, **storage_options)


class StorageError(OSError):
    """A URL could not be listed, found, read or written. The message names the URL, never a credential.

    An OSError, so that callers handling I/O failures handle these too.
    """


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A StorageError about an object or path that is not there: callers that treat a missing file
    on their own (`except FileNotFoundError`) keep doing so when a retry policy wrapped the error."""


def redact(text: str) -> str:
    """`text` with the value of every secret credential variable of this process replaced by ***."""
    for name in _SECRET_ENV_VARS:
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def filesystem_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """`url_filesystem`, with StorageError for a protocol no installed fsspec backend serves."""
    try:
        return url_filesystem(url, storage_options)
    except (ImportError, ValueError) as e:
        raise StorageError(f"no filesystem for {url}: {redact(str(e))}") from e


def describe_error(action: str, url: str, error: BaseException) -> str:
    return f"cannot {action} {url}: {type(error).__name__}: {redact(str(error))}"

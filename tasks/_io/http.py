"""Stream one URL to a file with a progress bar, hashing as it goes, retrying transient failures only.

Transient: HTTP 500/502/503/504, connect and read timeouts, connection resets and bodies cut short.
Anything else (4xx, 501, bad URL, TLS errors) fails at once: retrying cannot fix it. Retries and their
exponential backoff are tenacity's, so every attempt starts a fresh file and a fresh hash. When the
transient failures outlast them, `TransientError` says so, and the caller (the Prefect task) may try
again minutes later; a refusal is a plain `StageError`, never retried.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import requests
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tqdm import tqdm

from tasks.errors import StageError, TransientError

log = logging.getLogger(__name__)

TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
CHUNK_BYTES = 1 << 20
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Fetched:
    path: Path
    sha256: str
    bytes: int
    attempts: int


class TransientStatus(Exception):
    """The server answered with a status worth retrying."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, requests.exceptions.SSLError):
        return False  # a certificate problem does not go away by asking again
    return isinstance(
        exc,
        TransientStatus
        | requests.ConnectionError
        | requests.Timeout
        | requests.exceptions.ChunkedEncodingError,
    )


def fetch(url: str, dest: Path, timeout_s: float, max_attempts: int, backoff_s: float) -> Fetched:
    """Download `url` to `dest`; raise StageError naming the URL, the failure and the fix."""
    dest = Path(dest)
    attempts = 0

    def log_retry(state: RetryCallState) -> None:
        wait = state.next_action.sleep if state.next_action else 0.0
        exc = state.outcome.exception() if state.outcome else None
        log.warning("GET %s: attempt %d/%d failed (%s); retrying in %.1f s", url, state.attempt_number, max_attempts, exc, wait)

    retrying = Retrying(
        stop=stop_after_attempt(max_attempts),
        wait=wait_exponential(multiplier=backoff_s, max=MAX_BACKOFF_S),
        retry=retry_if_exception(_is_transient),
        before_sleep=log_retry,
        reraise=True,
    )
    with requests.Session() as session:
        try:
            for attempt in retrying:
                with attempt:
                    attempts += 1
                    digest, size = _stream_once(session, url, dest, timeout_s)
        except TransientStatus as e:
            raise TransientError(
                f"GET {url}: {e} on all {attempts} attempts; the server is failing. Try again later, or raise "
                "download.max_attempts / download.backoff_s in params.yaml."
            ) from None
        except requests.RequestException as e:
            transient = _is_transient(e)
            what = "gave up after" if transient else "failed (not retried) on"
            raise (TransientError if transient else StageError)(
                f"GET {url}: {what} attempt {attempts}/{max_attempts}: {type(e).__name__}: {e}. Check the "
                "network and download.url, or set download.source: synthetic to use the embedded dataset."
            ) from None
    return Fetched(path=dest, sha256=digest, bytes=size, attempts=attempts)


def _stream_once(session: requests.Session, url: str, dest: Path, timeout_s: float) -> tuple[str, int]:
    with session.get(url, stream=True, timeout=(timeout_s, timeout_s)) as r:
        if r.status_code in TRANSIENT_STATUS:
            raise TransientStatus(r.status_code, r.reason)
        if r.status_code >= 400:
            raise StageError(
                f"GET {url}: HTTP {r.status_code} {r.reason} (not retried: the request itself is refused). "
                "Fix download.url in params.yaml, or set download.source: synthetic."
            )
        length = r.headers.get("Content-Length", "")
        total = int(length) if length.isdigit() else None  # only for the progress bar
        h = hashlib.sha256()
        size = 0
        with (
            dest.open("wb") as f,
            tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=None, leave=False) as bar,
        ):
            # urllib3 checks the body against Content-Length and raises on a short read (retried).
            for chunk in r.iter_content(CHUNK_BYTES):
                f.write(chunk)
                h.update(chunk)
                size += len(chunk)
                bar.update(len(chunk))
    return h.hexdigest(), size

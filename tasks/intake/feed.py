"""Where arriving batches come from: the drops of `intake.feed`, each with its content's sha256.

A drop is one arriving batch as its sender made it: a folder holding a table (`train.csv`, or the one
CSV / Parquet file in it) and the images its cells name, or a table file alone (no images). Kinds:

- `folder`: every entry of `feed.path` matching `feed.glob`, in name order;
- `url`: the entries of a listing (one URL per line, `name URL`, or a JSON list of {name, url}); each URL
  is a CSV, a Parquet file or a zip of a drop folder (extracted with every member checked);
- `synthetic`: the embedded generator's batch `download.synthetic.batch` (> 0).

The sha256 is over the drop's files (names and bytes), so the same drop is recognised under any name.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from fusion_model.dataset import DatasetSchema
from tasks._io.hashing import file_hashes, fingerprint, sha256_file
from tasks.errors import StageError
from tasks.params import FeedParams, SyntheticParams

TABLE_SUFFIXES = (".csv", ".parquet")
PREFERRED_TABLE = "train.csv"


@dataclass(frozen=True)
class Drop:
    name: str  # the drop's name in the feed (a file or folder name, a listing entry)
    path: Path  # a local folder or table file holding it
    sha256: str  # of its content: the fingerprint of its files' hashes (a single table: that file's)
    origin: str  # where it came from, for people (a path or a URL)
    batch: int | None = None  # the synthetic feed numbers its own batches


@dataclass(frozen=True)
class Fetching:
    """How a url feed's listing and drops are fetched: the per-request timeout, the tries on a transient
    failure and the first retry's wait. The intake passes the download section's, scoring its own."""

    timeout_s: float
    max_attempts: int
    backoff_s: float = 1.0


def drop_sha256(path: Path) -> str:
    return sha256_file(path) if path.is_file() else fingerprint(file_hashes(path))


def table_of(drop: Path) -> Path:
    """The table of a drop: the file itself, `train.csv` in the folder, or the folder's one table file."""
    if drop.is_file():
        if drop.suffix.lower() not in TABLE_SUFFIXES:
            raise StageError(f"{drop}: a drop must be a CSV or Parquet table, or a folder holding one; rename it to "
                             ".csv / .parquet, or narrow intake.feed.glob so it is not taken as a drop")
        return drop
    if (drop / PREFERRED_TABLE).is_file():
        return drop / PREFERRED_TABLE
    tables = sorted(p for p in drop.iterdir() if p.is_file() and p.suffix.lower() in TABLE_SUFFIXES)
    if len(tables) != 1:
        found = ", ".join(p.name for p in tables) or "none"
        raise StageError(f"{drop}: a drop folder holds one table (train.csv, or a single CSV / Parquet file); found "
                         f"{found}. Fix: leave one table in the folder, or name the batch's table train.csv")
    return tables[0]


def _folder_drops(feed: FeedParams) -> list[Drop]:
    if feed.path is None:
        raise StageError("intake.feed.kind is folder but intake.feed.path is not set; set it to the folder "
                         "batches arrive in")
    root = Path(feed.path)
    if not root.is_dir():
        raise StageError(f"{root}: no such folder (intake.feed.path); create it or point the key at the feed")
    entries = sorted(e for e in root.glob(feed.glob) if not e.name.startswith("."))
    return [Drop(name=e.name, path=e, sha256=drop_sha256(e), origin=str(e)) for e in entries]


def _listing(text: str, listing_url: str) -> list[tuple[str, str]]:
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            entries = json.loads(stripped)
            return [(str(e["name"]), str(e["url"])) for e in entries]
        except (ValueError, KeyError, TypeError) as e:
            raise StageError(f"{listing_url}: a JSON listing must be a list of {{\"name\": ..., \"url\": ...}} "
                             f"({e}); fix the listing") from None
    out = []
    for line in stripped.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        url = parts[-1]
        name = parts[0] if len(parts) > 1 else Path(unquote(urlparse(url).path)).name
        out.append((name, url))
    return out


def _get(url: str, dest: Path, fetching: Fetching) -> None:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        source = Path(unquote(parsed.path))
        if not source.is_file():
            raise StageError(f"{url}: no such file; fix the feed listing")
        shutil.copyfile(source, dest)
        return
    from tasks._io.http import fetch

    fetch(url, dest, fetching.timeout_s, fetching.max_attempts, fetching.backoff_s)


def _url_drops(feed: FeedParams, work: Path, fetching: Fetching) -> list[Drop]:
    if feed.url is None:
        raise StageError("intake.feed.kind is url but intake.feed.url is not set; set it to the listing's URL")
    work.mkdir(parents=True, exist_ok=True)
    listing = work / "listing.txt"
    _get(feed.url, listing, fetching)
    drops = []
    seen: set[str] = set()
    for name, url in _listing(listing.read_text(encoding="utf-8"), feed.url):
        if name in seen:
            raise StageError(f"{feed.url}: the listing names the drop {name!r} twice; give each drop its own name")
        seen.add(name)
        got = work / "files" / name
        got.parent.mkdir(parents=True, exist_ok=True)
        suffix = Path(urlparse(url).path).suffix.lower()
        if suffix == ".zip":
            from tasks._io.safe_zip import safe_extract

            archive = work / f"{name}.zip"
            _get(url, archive, fetching)
            shutil.rmtree(got, ignore_errors=True)
            got.mkdir()
            safe_extract(archive, got)
            inner = [c for c in got.iterdir()]
            if len(inner) == 1 and inner[0].is_dir():  # a zip of one folder: that folder is the drop
                got = inner[0]
        else:
            got = got.with_name(name if Path(name).suffix else name + (suffix or ".csv"))
            _get(url, got, fetching)
        drops.append(Drop(name=name, path=got, sha256=drop_sha256(got), origin=url))
    return drops


def _synthetic_drop(synthetic: SyntheticParams, schema: DatasetSchema, work: Path) -> list[Drop]:
    from tasks.download.synthetic.generator import generate_batch

    batch = synthetic.batch
    if batch < 1:
        return []
    folder = work / f"batch-{batch:04d}"
    try:
        generate_batch(folder, synthetic, batch, schema.label.problem_type)
    except ValueError as e:
        raise StageError(f"download.synthetic: {e}") from None
    return [Drop(name=folder.name, path=folder, sha256=drop_sha256(folder), origin="embedded generator",
                 batch=batch)]


def list_drops(feed: FeedParams, schema: DatasetSchema, work: Path, fetching: Fetching,
               synthetic: SyntheticParams | None = None) -> list[Drop]:
    """The feed's drops, oldest (name order) first; `work` is a scratch folder for fetched or generated ones.
    `fetching` serves the url kind; `synthetic` (the generator's settings, its batch) the synthetic kind."""
    if feed.kind == "folder":
        return _folder_drops(feed)
    if feed.kind == "url":
        return _url_drops(feed, work / "url", fetching)
    if synthetic is None:  # a caller reading folders or listings only (scoring) never asks for this kind
        raise ValueError("a synthetic feed needs the generator's settings (download.synthetic)")
    return _synthetic_drop(synthetic, schema, work / "synthetic")

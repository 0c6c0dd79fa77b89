"""The download stage against a real HTTP server on 127.0.0.1, and the embedded dataset through the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from zip_server import ZipServer, zip_of

from tasks.download import download
from tasks.download.manifest import DATASET_DIRNAME
from tasks.download.url import ARCHIVE_DIRNAME
from tasks.errors import StageError, TransientError
from tasks.params import DownloadParams, SyntheticParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def server() -> Iterator[ZipServer]:
    s = ZipServer().start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tutorial_zip(tiny_raw_dataset: Path) -> bytes:
    """The tiny dataset zipped like the tutorial: members under `petfinder_for_tutorial/`."""
    return zip_of(tiny_raw_dataset)


def _zip_with(member: zipfile.ZipInfo, data: bytes = b"x") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{ARCHIVE_DIRNAME}/train.csv", ",Type\n0,1\n")
        zf.writestr(member, data)
    return buf.getvalue()


def _params(url: str, out_dir: Path, **kw: object) -> DownloadParams:
    kw = {"timeout_s": 10, "backoff_s": 0.01, **kw}
    return DownloadParams(source="url", url=url, out_dir=out_dir, **kw)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _sha(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_nothing_left_beside(out_dir: Path) -> None:
    assert [p.name for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")] == []


def test_an_interrupted_swap_is_recovered_even_when_the_next_run_fails(tmp_path: Path) -> None:
    # A run killed between its two renames leaves only the backup of the previous tree, and its staging
    # folder; the next run puts the backup back first, so its own failure loses nothing.
    out = tmp_path / "raw"
    (tmp_path / ".raw.old-12345678" / "kept").mkdir(parents=True)
    (tmp_path / ".raw.old-12345678" / "kept" / "train.csv").write_text("previous")
    (tmp_path / ".raw.incoming-87654321").mkdir()
    s = ZipServer()  # bound, never serving, then closed: connections are refused
    url = s.url("/petfinder.zip")
    s.httpd.server_close()
    with pytest.raises(StageError):
        download(_params(url, out, max_attempts=1))
    assert (out / "kept" / "train.csv").read_text() == "previous"
    _assert_nothing_left_beside(out)


pytestmark = pytest.mark.slow  # a real server per test (fast, but a server)


def test_url_download_writes_layout_and_manifest(
    server: ZipServer, tutorial_zip: bytes, tiny_raw_dataset: Path, tmp_path: Path
) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    out = tmp_path / "data" / "raw"
    summary = download(_params(server.url("/petfinder.zip"), out, sha256=_sha(tutorial_zip).upper()))

    assert _tree(out / DATASET_DIRNAME) == _tree(tiny_raw_dataset)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "url" and manifest["url"] == server.url("/petfinder.zip")
    assert manifest["sha256"] == _sha(tutorial_zip) == summary.sha256
    assert manifest["rows"] == {"train": 240, "test": 80} == summary.rows
    assert sum(manifest["label_counts"]["train"].values()) == 240
    assert set(manifest["label_counts"]["test"]) == {"0", "1"}
    assert manifest["files"] == _tree(out / DATASET_DIRNAME)
    assert summary.attempts == 1 and server.hits["/petfinder.zip"] == 1
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", DATASET_DIRNAME])
    _assert_nothing_left_beside(out)


def test_sha256_mismatch_fails_and_leaves_nothing(server: ZipServer, tutorial_zip: bytes, tmp_path: Path) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    out = tmp_path / "raw"
    with pytest.raises(StageError) as e:
        download(_params(server.url("/petfinder.zip"), out, sha256="0" * 64))
    message = str(e.value)
    assert _sha(tutorial_zip) in message and "0" * 64 in message
    assert "does not match the pinned download.sha256" in message and "pin its sha256" in message
    assert not out.exists()
    _assert_nothing_left_beside(out)


def test_transient_503_is_retried_then_succeeds(server: ZipServer, tutorial_zip: bytes, tmp_path: Path) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    server.faults["/petfinder.zip"] = [503, 503]
    summary = download(_params(server.url("/petfinder.zip"), tmp_path / "raw"))
    assert server.hits["/petfinder.zip"] == 3
    assert summary.attempts == 3
    assert (tmp_path / "raw" / DATASET_DIRNAME / "train.csv").is_file()


def test_short_body_and_read_timeout_are_retried(server: ZipServer, tutorial_zip: bytes, tmp_path: Path) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    server.faults["/petfinder.zip"] = ["short", "slow"]
    url = server.url("/petfinder.zip")
    summary = download(_params(url, tmp_path / "raw", sha256=_sha(tutorial_zip), timeout_s=1.5))
    assert summary.attempts == 3 and server.hits["/petfinder.zip"] == 3


def test_persistent_5xx_gives_up_after_max_attempts(server: ZipServer, tutorial_zip: bytes, tmp_path: Path) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    server.faults["/petfinder.zip"] = [502, 503, 500, 504]
    with pytest.raises(TransientError, match=r"HTTP 500 .* on all 3 attempts.*download.max_attempts"):
        download(_params(server.url("/petfinder.zip"), tmp_path / "raw", max_attempts=3))
    assert server.hits["/petfinder.zip"] == 3


def test_404_fails_fast_without_retry(server: ZipServer, tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"HTTP 404 .*not retried.*download.url") as refused:
        download(_params(server.url("/missing.zip"), tmp_path / "raw"))
    assert not isinstance(refused.value, TransientError)  # a refusal: the flow never retries it
    assert server.hits["/missing.zip"] == 1
    assert not (tmp_path / "raw").exists()


def test_unreachable_server_names_url_and_fix(tmp_path: Path) -> None:
    s = ZipServer()  # bound but never serving, then closed: the port refuses connections
    url = s.url("/petfinder.zip")
    s.httpd.server_close()
    with pytest.raises(TransientError, match=r"gave up after attempt 2/2.*download.source: synthetic") as e:
        download(_params(url, tmp_path / "raw", max_attempts=2))
    assert url in str(e.value)


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (zipfile.ZipInfo(f"{ARCHIVE_DIRNAME}/../../evil.txt"), "zip-slip"),
        (zipfile.ZipInfo("../evil.txt"), "zip-slip"),
        (zipfile.ZipInfo("/tmp/evil.txt"), "absolute path"),
    ],
    ids=["nested-dotdot", "dotdot", "absolute"],
)
def test_members_escaping_the_target_are_refused_before_extraction(
    server: ZipServer, tmp_path: Path, member: zipfile.ZipInfo, reason: str
) -> None:
    server.routes["/evil.zip"] = _zip_with(member)
    out = tmp_path / "a" / "b" / "raw"
    with pytest.raises(StageError, match=rf"{reason}.*refusing to extract anything") as e:
        download(_params(server.url("/evil.zip"), out))
    assert repr(member.filename) in str(e.value)
    assert not list(tmp_path.rglob("evil.txt"))
    assert not out.exists()
    _assert_nothing_left_beside(out)


def test_symlink_member_is_refused(server: ZipServer, tmp_path: Path) -> None:
    link = zipfile.ZipInfo(f"{ARCHIVE_DIRNAME}/images/a.jpg")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    server.routes["/link.zip"] = _zip_with(link, b"/etc/passwd")
    with pytest.raises(StageError, match=r"'petfinder_for_tutorial/images/a.jpg' is a symbolic link"):
        download(_params(server.url("/link.zip"), tmp_path / "raw"))
    assert not (tmp_path / "raw").exists()


@pytest.mark.parametrize("kind", ["truncated", "html"])
def test_truncated_or_non_zip_file_gives_clear_error(
    server: ZipServer, tutorial_zip: bytes, tmp_path: Path, kind: str
) -> None:
    body = tutorial_zip[: len(tutorial_zip) // 2] if kind == "truncated" else b"<html>Access denied</html>"
    server.routes["/petfinder.zip"] = body
    with pytest.raises(StageError, match=rf"not a readable zip archive \({len(body)} bytes.*truncated"):
        download(_params(server.url("/petfinder.zip"), tmp_path / "raw"))
    assert not (tmp_path / "raw").exists()
    _assert_nothing_left_beside(tmp_path / "raw")


def test_zip_without_the_tutorial_layout_is_refused(server: ZipServer, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("data/train.csv", ",Type\n0,1\n")
    server.routes["/other.zip"] = buf.getvalue()
    with pytest.raises(StageError, match=r"no petfinder_for_tutorial/train.csv, petfinder_for_tutorial/test.csv"):
        download(_params(server.url("/other.zip"), tmp_path / "raw"))


def test_failed_download_keeps_the_previous_good_copy(server: ZipServer, tutorial_zip: bytes, tmp_path: Path) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    out = tmp_path / "raw"
    download(_params(server.url("/petfinder.zip"), out))
    before = _tree(out)
    server.routes["/petfinder.zip"] = tutorial_zip[:1000]
    with pytest.raises(StageError):
        download(_params(server.url("/petfinder.zip"), out))
    assert _tree(out) == before
    _assert_nothing_left_beside(out)


def test_success_replaces_the_previous_tree_entirely(tmp_path: Path) -> None:
    out = tmp_path / "raw"
    (out / "stale").mkdir(parents=True)
    (out / "stale" / "old.txt").write_text("from an earlier run")
    small = SyntheticParams(n_train=20, n_test=10, image_size=8, seed=1)
    summary = download(DownloadParams(out_dir=out, synthetic=small))
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", DATASET_DIRNAME])
    assert summary.source == "synthetic" and summary.rows == {"train": 20, "test": 10}
    _assert_nothing_left_beside(out)


def test_synthetic_download_manifest_is_deterministic_and_hashes_every_file(tmp_path: Path) -> None:
    small = SyntheticParams(n_train=30, n_test=10, image_size=16, seed=5)
    download(DownloadParams(out_dir=tmp_path / "a", synthetic=small))
    download(DownloadParams(out_dir=tmp_path / "b", synthetic=small))
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["source"] == "synthetic" and manifest["synthetic"]["seed"] == 5
    assert manifest["files"] == _tree(tmp_path / "a" / DATASET_DIRNAME)
    assert manifest["rows"] == {"train": 30, "test": 10}


def _cli(params: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "params.yaml").write_text(yaml.safe_dump({"download": params}))
    return subprocess.run(
        [sys.executable, "-m", "tasks", "download", "--params", str(cwd / "params.yaml"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def test_cli_writes_the_layout_offline(tmp_path: Path) -> None:
    out = tmp_path / "raw"
    small = {"n_train": 40, "n_test": 12, "image_size": 16, "seed": 2}
    result = _cli({"source": "synthetic", "synthetic": small}, "--out-dir", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"] == {"train": 40, "test": 12}
    for name in ("train.csv", "test.csv", "images"):
        assert (out / DATASET_DIRNAME / name).exists()
    assert (out / "manifest.json").is_file()


def test_cli_reports_a_failed_download_without_traceback(server: ZipServer, tmp_path: Path) -> None:
    result = _cli({"source": "url", "url": server.url("/gone.zip")}, "--out-dir", str(tmp_path / "raw"), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("error: download: GET ") and "HTTP 404" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("bad", "key"),
    [({"sha256": "abc123"}, "sha256"), ({"url": "ftp://example.org/x.zip"}, "url"), ({"max_attempts": 0}, "max_attempts"),
     ({"source": "s3"}, "source")],
)
def test_bad_download_params_are_refused_naming_the_key(bad: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        DownloadParams(**bad)


def test_a_pinned_download_already_on_disk_is_kept_and_nothing_fetched(
    server: ZipServer, tutorial_zip: bytes, tmp_path: Path
) -> None:
    server.routes["/petfinder.zip"] = tutorial_zip
    out = tmp_path / "raw"
    params = _params(server.url("/petfinder.zip"), out, sha256=_sha(tutorial_zip))
    assert not download(params).up_to_date
    before, manifest_inode = _tree(out), (out / "manifest.json").stat().st_ino
    again = download(params)
    assert again.up_to_date and again.attempts == 0 and server.hits["/petfinder.zip"] == 1
    assert _tree(out) == before and (out / "manifest.json").stat().st_ino == manifest_inode
    assert again.sha256 == _sha(tutorial_zip) and again.rows == {"train": 240, "test": 80}
    # a damaged file on disk: fetched again and the tree restored
    damaged = next(p for p in sorted((out / DATASET_DIRNAME).rglob("*")) if p.is_file())
    damaged.write_bytes(b"damaged")
    restored = download(params)
    assert not restored.up_to_date and server.hits["/petfinder.zip"] == 2 and _tree(out) == before
    # unpinned, the URL may have changed upstream: fetched every run
    download(_params(server.url("/petfinder.zip"), out))
    assert server.hits["/petfinder.zip"] == 3


def test_the_embedded_table_is_rebuilt_only_when_its_keys_change(tmp_path: Path) -> None:
    out = tmp_path / "raw"
    small = SyntheticParams(n_train=20, n_test=10, image_size=8, seed=1)
    assert not download(DownloadParams(out_dir=out, synthetic=small)).up_to_date
    before, inode = _tree(out), (out / "manifest.json").stat().st_ino
    assert download(DownloadParams(out_dir=out, synthetic=small)).up_to_date
    assert _tree(out) == before and (out / "manifest.json").stat().st_ino == inode
    other = download(DownloadParams(out_dir=out, synthetic=small.model_copy(update={"seed": 2})))
    assert not other.up_to_date and _tree(out) != before

"""The model a server answers with, and its hot swap when the champion link changes target.

`ModelWatcher` holds one `LoadedModel` (a Predictor and what names it). When the served path is a symlink
(the registry's `models/champion -> store/<sha256>`, flipped by one atomic rename), a background thread
compares `os.readlink` with the target it loaded, at most every `interval` seconds or at once when a
request pokes it. A new target is loaded beside the old model, verified (strict weights, its folder's
sha256, one probe row through the network), and only then becomes `current` in one reference assignment.
A request reads `current` once at its start, so its whole answer comes from one model and names it. A
target that fails to load is logged with the reason and the old model keeps serving.

Version: the registry numbers promotions (1, 2, ...) in `champions.jsonl` beside the champion link, the
last line naming a sha256 gives its version ("2"). A model the log does not name (a plain folder, or a
link flipped whose log line is not written yet) is named by the first 12 characters of its sha256; the
log is re-read when it changes, so a promotion's number appears once its line is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fusion_model.layout import MODEL_CONFIG, WEIGHTS
from fusion_model.predict import PredictError, Predictor

log = logging.getLogger("fusion_model.serve")

CHAMPIONS_LOG = "champions.jsonl"  # the registry's promotion log (tasks/promote/registry.py), read only
METRICS_FILE = "metrics.json"  # the evaluation the registry keeps in each store folder
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
RETRY_FAILED_S = 30.0  # a target that failed to load is tried again after this long (it may be repaired)


@dataclass(frozen=True)
class LoadedModel:
    """One loaded, verified model and its names; never changed (a new version label is a new object)."""

    predictor: Predictor
    folder: Path  # the folder actually loaded (the link's target, resolved)
    sha256: str  # of its model.safetensors
    version: str
    version_source: str  # "champions.jsonl" or "sha256" (no log line names this model)
    metrics: dict[str, Any] | None
    loaded_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def names(self) -> dict[str, str]:
        return {"version": self.version, "sha256": self.sha256}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def registry_version(log_file: Path | None, sha: str) -> str | None:
    """The version champions.jsonl gives `sha` (its last promotion or rollback line), else None.

    Read as plain JSON lines, tolerantly: a line a crash cut short is skipped, as the registry does."""
    if log_file is None or not log_file.is_file():
        return None
    version = None
    for line in log_file.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("sha256") == sha and record.get("version") is not None:
            version = str(record["version"])
    return version


def _read_metrics(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / METRICS_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("%s: cannot be read (%s); /model shows no metrics", folder / METRICS_FILE, e)
        return None
    return data if isinstance(data, dict) else None


def probe(predictor: Predictor) -> None:
    """One synthetic row through the whole network: empty values (unseen codes, no text, missing numbers)
    and, where the model has an image column, a small grey photo. Raises PredictError on a bad output.

    The row checks are skipped on purpose (they would refuse the empty values): this tests the weights,
    not a request. It costs one forward pass of one row."""
    from PIL import Image

    from fusion_model.data import FusionDataset

    pre = predictor.pre
    plain = pre.plain_numeric_columns
    row: dict[str, Any] = {c: None for c in [*predictor.schema.feature_columns, *plain, *pre.categorical_columns]}
    row.update({c: "" for c in pre.text_columns})
    with tempfile.TemporaryDirectory(prefix="fusion-probe-") as tmp:
        if pre.image_columns:
            Image.new("RGB", (8, 8), (128, 128, 128)).save(Path(tmp, "probe.png"))
            row.update({c: "probe.png" for c in pre.image_columns})
        dataset = FusionDataset(pd.DataFrame([row]), pre, Path(tmp))
        batch = {k: v.unsqueeze(0) for k, v in dataset[0].items()}
        with torch.inference_mode():
            out = predictor.model.interpret(predictor.model(batch))
    if out.prediction.shape[0] != 1:
        raise PredictError(f"the probe row gave {out.prediction.shape[0]} predictions, not 1")
    if out.proba is not None:
        if tuple(out.proba.shape) != (1, len(predictor.classes)):
            raise PredictError(f"the probe row's probabilities have shape {tuple(out.proba.shape)}, "
                               f"not (1, {len(predictor.classes)}) as model_config.json's classes say")
        if not all(math.isfinite(float(p)) for p in out.proba.flatten()):
            raise PredictError("the probe row's probabilities are not finite: the weights are damaged")


def load_model(folder: Path, log_file: Path | None = None) -> LoadedModel:
    """Load `folder` strictly and verify it (see `probe`); PredictError names what is wrong."""
    weights = folder / WEIGHTS
    if not weights.is_file() or not (folder / MODEL_CONFIG).is_file():
        raise PredictError(f"{folder} lacks {WEIGHTS} or {MODEL_CONFIG}; point --model at a converted model folder "
                           "or the registry's champion link")
    sha = sha256_file(weights)
    if SHA256_NAME.match(folder.name) and folder.name != sha:  # a registry store folder is named by its weights
        raise PredictError(f"{weights} has sha256 {sha}, not its store folder's name: the stored model changed; "
                           "restore it from a backup or roll back to another version")
    predictor = Predictor.load(folder)
    probe(predictor)
    version = registry_version(log_file, sha)
    return LoadedModel(predictor=predictor, folder=folder, sha256=sha, version=version or sha[:12],
                       version_source="champions.jsonl" if version else "sha256", metrics=_read_metrics(folder))


def _file_stamp(path: Path | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st else None


class ModelWatcher:
    """The served model (`current`) and the thread that swaps it when the link at `path` changes target."""

    def __init__(self, path: str | Path, interval: float = 1.0) -> None:
        self.path = Path(path)
        self.interval = interval
        self.is_link = self.path.is_symlink()  # only a link can change target; a plain folder is served as loaded
        self.log_file = self.path.parent / CHAMPIONS_LOG if self.is_link else None
        self._target = self._read_target()
        folder = self._resolve(self._target)
        if self.log_file is None and (folder.parent.parent / CHAMPIONS_LOG).is_file():
            self.log_file = folder.parent.parent / CHAMPIONS_LOG  # --model named a store folder directly
        self._log_stamp = _file_stamp(self.log_file)
        self.current: LoadedModel = load_model(folder, self.log_file)  # a broken start is an error, no fallback
        self.last_error: str | None = None
        self._failed: dict[str, float] = {}  # target -> when it failed to load
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_target(self) -> str | None:
        """The link's target text, or None when `path` is a plain folder (nothing to watch)."""
        try:
            return os.readlink(self.path)
        except OSError:  # not a link (EINVAL), or gone for a moment: keep what is loaded
            return None

    def _resolve(self, target: str | None) -> Path:
        return self.path.resolve() if target is None else (self.path.parent / target).resolve()

    def poke(self) -> None:
        """Called on every request: one readlink; a changed target wakes the loader (the request itself is
        answered by the model it already took, never kept waiting for a load)."""
        if self.is_link and self._read_target() != self._target:
            self._wake.set()

    def check(self) -> bool:
        """Swap to the link's new target if it changed and loads; True when `current` was replaced."""
        target = self._read_target()
        if target is None or target == self._target:
            return self._refresh_version()
        failed_at = self._failed.get(target)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_FAILED_S:
            return False
        folder = self._resolve(target)
        try:
            new = load_model(folder, self.log_file)
        except Exception as e:  # any failure keeps the old model: a server must not go down with a bad promotion
            self._failed[target] = time.monotonic()
            self.last_error = f"{self.path} -> {target}: not loaded ({type(e).__name__}: {e}); still serving " \
                              f"version {self.current.version} ({self.current.sha256[:12]})"
            log.error("%s. Fix the model folder or point the link back; it is tried again in %.0f s",
                      self.last_error, RETRY_FAILED_S)
            return False
        old, self.current, self._target = self.current, new, target  # the swap: one reference
        self._failed.pop(target, None)
        self.last_error = None
        self._log_stamp = _file_stamp(self.log_file)
        log.info("now serving version %s (%s) from %s; was version %s (%s)", new.version, new.sha256[:12],
                 folder, old.version, old.sha256[:12])
        return True

    def _refresh_version(self) -> bool:
        """A model named by its sha256 gets its registry number once champions.jsonl gains its line."""
        stamp = _file_stamp(self.log_file)
        if self.current.version_source == "champions.jsonl" or stamp == self._log_stamp:
            return False
        self._log_stamp = stamp
        version = registry_version(self.log_file, self.current.sha256)
        if version is None:
            return False
        self.current = replace(self.current, version=version, version_source="champions.jsonl")
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # the watch thread must outlive anything odd on disk
                log.exception("checking %s for a new model failed; trying again", self.path)
            self._wake.wait(self.interval)
            self._wake.clear()

    def start(self) -> None:
        if self._thread is None and self.is_link:
            self._thread = threading.Thread(target=self._run, name="model-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def describe(self) -> dict[str, Any]:
        """What /model shows of the watch: the link, its target, the last failed swap."""
        return {"path": str(self.path), "link_target": self._target, "watching": self._thread is not None,
                "interval_s": self.interval, "last_error": self.last_error}

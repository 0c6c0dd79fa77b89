"""The HTTP endpoint (fusion_model/serve.py): a real uvicorn server in a subprocess, called over real HTTP.

Answers equal Predictor.predict on the same rows; bad requests get a 4xx naming the field; base64 photos
work; a promotion, a broken promotion and a rollback of the champion link while requests keep coming: no
request fails, and each answer names the model that produced it and carries that model's predictions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
from safetensors.torch import load_file, save_file

from fusion_model.predict import Predictor, read_rows_csv

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # the shared fixture trains and converts two real models (minutes on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, images_root: Path, tmpdir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`python -m fusion_model.serve` on a free loopback port, ready when /health answers (polled)."""
    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmpdir)}  # the per-request folders land here, to check they go
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion_model.serve", "--model", str(model), "--images-root", str(images_root),
         "--port", str(port), "--watch-interval", "0.2"],
        cwd=ROOT, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # a poll interval, not a guess at the start-up time
    proc.kill()
    raise AssertionError(f"no /health answer within 180 s:\n{log_path.read_text()[-3000:]}")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def point(link: Path, target: str) -> None:
    """The registry's flip: a new link beside the old one, renamed over it in one step."""
    tmp = link.with_name(f".{link.name}.link-test")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def log_event(models: Path, event: str, version: int, sha: str) -> None:
    with open(models / "champions.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "version": version, "sha256": sha, "at": "2026-01-01T00:00:00+00:00"}) + "\n")


def as_json_rows(df: pd.DataFrame) -> list[dict]:
    """Rows as a client would send them: NaN as null, numpy scalars as JSON numbers."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v.item() if isinstance(v, np.generic) else v)
             for k, v in rec.items()} for rec in df.to_dict(orient="records")]


def assert_same(answer: list[dict], expected: pd.DataFrame) -> None:
    got = pd.DataFrame(answer)
    assert list(got.columns) == list(expected.columns)
    for col in expected.columns:
        if expected[col].dtype.kind == "f":  # float32 from the model, sent as its exact double value
            np.testing.assert_array_equal(got[col].to_numpy(np.float32), expected[col].to_numpy(np.float32))
        else:
            assert got[col].tolist() == expected[col].tolist(), col


@dataclass
class Served:
    url: str
    models: Path  # the registry folder: champion link, store/, champions.jsonl
    images_root: Path
    tmpdir: Path
    sha: dict[str, str]  # "trained" / "constant" / "broken" -> sha256
    rows: pd.DataFrame  # new rows (the raw test CSV without its label)
    predictors: dict[str, Predictor]  # sha256 -> the model loaded here
    original_root: Path
    log: Path

    def expected(self, sha: str, rows: pd.DataFrame) -> pd.DataFrame:
        """Predictor.predict on exactly these rows (a batch's size moves float32 results by an ulp)."""
        return self.predictors[sha].predict(rows, self.original_root)


@pytest.fixture(scope="module")
def served(tiny_model_chain, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    chain = tiny_model_chain
    work = tmp_path_factory.mktemp("serve")
    images_root = work / "dataset"  # a copy, so a symlink out of it can be added
    shutil.copytree(chain.images_root, images_root)
    (images_root / "images" / "escape.jpg").symlink_to(chain.images_root / "images" / os.listdir(chain.images_root / "images")[0])
    models, sha = work / "models", {}
    for name, folder in (("trained", chain.trained), ("constant", chain.constant)):  # two real converted models
        sha[name] = sha256_of(folder / "model.safetensors")
        shutil.copytree(folder, models / "store" / sha[name])
        shutil.copy2(getattr(chain, f"{name}_eval") / "metrics.json", models / "store" / sha[name] / "metrics.json")
    # a promotion whose weights lack a tensor its config needs (a strict load refuses it), kept by its sha256
    state = load_file(chain.trained / "model.safetensors")
    state.pop(sorted(state)[-1])
    save_file(state, work / "broken.safetensors")
    sha["broken"] = sha256_of(work / "broken.safetensors")
    shutil.copytree(chain.trained, models / "store" / sha["broken"])
    shutil.copy2(work / "broken.safetensors", models / "store" / sha["broken"] / "model.safetensors")
    point(models / "champion", f"store/{sha['trained']}")
    log_event(models, "promoted", 1, sha["trained"])
    raw = pd.read_csv(chain.images_root / "test.csv", index_col=0).drop(columns=["AdoptionSpeed"])
    raw.to_csv(work / "new.csv")
    rows = read_rows_csv(work / "new.csv").head(40).reset_index(drop=True)
    predictors = {sha[n]: Predictor.load(models / "store" / sha[n]) for n in ("trained", "constant")}
    tmpdir = work / "server_tmp"
    tmpdir.mkdir()
    proc, url = start_server(models / "champion", images_root, tmpdir, work / "server.log")
    try:
        yield Served(url, models, images_root, tmpdir, sha, rows, predictors, chain.images_root, work / "server.log")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_predictions_equal_predictor_predict(served: Served) -> None:
    rows = as_json_rows(served.rows)
    r = httpx.post(f"{served.url}/predict", json={"rows": rows}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == {"version": "1", "sha256": served.sha["trained"]}
    assert_same(body["predictions"], served.expected(served.sha["trained"], served.rows))
    one = httpx.post(f"{served.url}/predict", json={"rows": rows[3:4]}, timeout=60).json()
    assert_same(one["predictions"], served.expected(served.sha["trained"], served.rows.iloc[3:4]))


def test_health_and_model(served: Served) -> None:
    health = httpx.get(f"{served.url}/health").json()
    assert health == {"status": "ok", "version": "1", "sha256": served.sha["trained"]}
    info = httpx.get(f"{served.url}/model").json()
    folder = served.models / "store" / served.sha["trained"]
    assert info["version"] == "1" and info["version_source"] == "champions.jsonl"
    assert info["metrics"] == json.loads((folder / "metrics.json").read_text())
    assert info["dataset"] == json.loads((folder / "model_config.json").read_text())["dataset"]
    assert info["classes"] == [0, 1] and info["watch"]["last_error"] is None


def _detail(r: httpx.Response) -> list[dict]:
    body = r.json()
    assert body["message"] and body["detail"], body
    return body["detail"]


def test_bad_requests_get_a_4xx_naming_the_field(served: Served) -> None:
    rows = as_json_rows(served.rows.head(3))
    post = lambda **kw: httpx.post(f"{served.url}/predict", timeout=60, **kw)  # noqa: E731
    bad_json = post(content=b'{"rows": [', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in _detail(bad_json)[0]["msg"]
    assert _detail(post(json={"row": rows}))[0]["loc"] == ["body", "rows"]
    assert post(json={"rows": {}}).status_code == 422 and post(json=[1]).status_code == 422

    no_age = [dict(r) for r in rows]
    del no_age[1]["Age"]
    r = post(json={"rows": no_age})
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 1, "Age"]
    assert "missing" in _detail(r)[0]["msg"]

    typed = [dict(r) for r in rows]
    typed[2]["Fee"] = {"amount": 3}
    typed[0]["Age"] = "twelve"  # a string where a number belongs: the predictor's own check refuses it
    r = post(json={"rows": typed})
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 2, "Fee"] and "wrong type" in _detail(r)[0]["msg"]
    typed[2]["Fee"] = 0
    r = post(json={"rows": typed})
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 0, "Age"]
    assert "not a number" in _detail(r)[0]["msg"]

    for cell, why in (("../outside.jpg", ".."), ("/etc/hostname", "absolute"), ("images/escape.jpg", "outside")):
        unsafe = [dict(r) for r in rows]
        unsafe[1]["Images"] = cell
        r = post(json={"rows": unsafe})
        assert r.status_code == 422, r.text
        assert _detail(r)[0]["loc"] == ["body", "rows", 1, "Images"] and why in _detail(r)[0]["msg"], _detail(r)
    missing = [dict(r) for r in rows]
    missing[2]["Images"] = "images/no-such-photo.jpg"
    r = post(json={"rows": missing})
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 2, "Images"] and "not found" in r.text
    assert httpx.get(f"{served.url}/health").status_code == 200  # still up


def test_base64_photos_give_the_same_predictions(served: Served) -> None:
    rows = as_json_rows(served.rows.head(6))
    def upload(path: str, prefix: str = "") -> dict:
        return {"base64": prefix + base64.b64encode((served.images_root / path).read_bytes()).decode()}

    # uploads mixed with path cells in one request, and within one cell (the photos' order kept)
    photos = {i: rows[i]["Images"].split(";") for i in (0, 2, 5)}
    rows[0]["Images"] = upload(photos[0][0]) if len(photos[0]) == 1 else [upload(p) for p in photos[0]]
    rows[2]["Images"] = [photos[2][0], *(upload(p) for p in photos[2][1:])]
    rows[5]["Images"] = [upload(p, "data:image/jpeg;base64,") for p in photos[5]]
    r = httpx.post(f"{served.url}/predict", json={"rows": rows}, timeout=60)
    assert r.status_code == 200, r.text
    assert_same(r.json()["predictions"], served.expected(served.sha["trained"], served.rows.head(6)))
    bad = [dict(rows[0], Images={"base64": "%%% not base64"})]
    r = httpx.post(f"{served.url}/predict", json={"rows": bad}, timeout=60)
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 0, "Images"]
    junk = [dict(rows[0], Images={"base64": base64.b64encode(b"not a photo").decode()})]
    r = httpx.post(f"{served.url}/predict", json={"rows": junk}, timeout=60)
    assert r.status_code == 422 and _detail(r)[0]["loc"] == ["body", "rows", 0, "Images"] and "decode" in r.text
    assert list(served.tmpdir.iterdir()) == []  # every request's upload folder was removed


def test_promotion_failed_promotion_and_rollback_under_load(served: Served) -> None:
    rows = as_json_rows(served.rows.head(8))
    sha_a, sha_b = served.sha["trained"], served.sha["constant"]
    expected = {sha: served.expected(sha, served.rows.head(8)) for sha in (sha_a, sha_b)}
    allowed = {sha_a: {"1"}, sha_b: {"2", sha_b[:12]}}  # a flip is logged just after it (registry order)
    answers: list[tuple[int, dict | str]] = []
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set() and len(answers) < 2000:  # bounded in count and (below) in time
                r = client.post(f"{served.url}/predict", json={"rows": rows})
                answers.append((r.status_code, r.json() if r.status_code == 200 else r.text))

    def wait_for(sha: str) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if answers and answers[-1][0] == 200 and answers[-1][1]["model"]["sha256"] == sha:
                return
            time.sleep(0.05)
        raise AssertionError(f"no answer from {sha[:12]} within 60 s:\n{served.log.read_text()[-3000:]}")

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(sha_a)
        point(served.models / "champion", f"store/{sha_b}")  # promotion
        log_event(served.models, "promoted", 2, sha_b)
        wait_for(sha_b)
        point(served.models / "champion", f"store/{served.sha['broken']}")  # a broken promotion: keeps serving B
        deadline = time.monotonic() + 30
        while httpx.get(f"{served.url}/model").json()["watch"]["last_error"] is None:
            assert time.monotonic() < deadline, "the broken target was never tried"
            time.sleep(0.05)
        assert httpx.get(f"{served.url}/health").json()["sha256"] == sha_b
        point(served.models / "champion", f"store/{sha_a}")  # rollback
        log_event(served.models, "rollback", 1, sha_a)
        wait_for(sha_a)
        n = len(answers)
        while len(answers) < n + 3:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    failed = [a for a in answers if a[0] != 200]
    assert not failed, failed[:3]
    seen = set()
    for _, body in answers:
        sha, version = body["model"]["sha256"], body["model"]["version"]
        assert sha in allowed and version in allowed[sha], body["model"]
        assert_same(body["predictions"], expected[sha])
        seen.add(sha)
    assert seen == {sha_a, sha_b}
    log = served.log.read_text()  # the failed load is logged with its reason
    assert f"store/{served.sha['broken']}: not loaded (PredictError" in log and "does not match" in log

"""Throughput and latency of the HTTP endpoint (fusion_model/serve.py) against a real local server.

    python bench/serve.py --model data/model --csv NEW.csv --images-root DIR [--requests 200] [--concurrency 4]

Starts `python -m fusion_model.serve` on a free 127.0.0.1 port (ready when /health answers), then, per
scenario, sends --requests POST /predict requests from --concurrency client threads: 1 and 32 rows per
request, with the rows' photos (paths under --images-root) and without (image cells null, so the model
sees no photo). Rows are taken from --csv in turn (cycled). A few warm-up requests per scenario are not
counted. Prints requests/s, rows/s and p50/p99 latency per scenario, and the count of failed requests.

`--swap-to MODEL_B`: the server then serves a champion link of a registry built in a temporary folder
(store/<sha256> of each model, `champion` -> A), and a last scenario flips the link to B and back to A
while the clients keep sending one-row requests: it reports the failed requests (the target is none) and
how many answers each model gave (every answer must name A or B).

A bounded local load: every request goes to the loopback address, the count is fixed, and the whole run
stops after --max-seconds. Wall-clock numbers: on a shared machine other processes compete for the cores
(say so with the results).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusion_model.model_watch import sha256_file  # noqa: E402
from fusion_model.predict import Predictor, read_rows_csv  # noqa: E402

WARMUP = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, images_root: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fusion_model.serve", "--model", str(model), "--images-root",
                             str(images_root), "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited {proc.returncode}; its log ({log}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the server did not answer /health within 300 s; see {log}")


def json_rows(path: Path, text_columns: list[str]) -> list[dict]:
    df = read_rows_csv(path, text_columns)
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v.item() if isinstance(v, np.generic) else v)
             for k, v in rec.items()} for rec in df.to_dict(orient="records")]


def post_predict(http: httpx.Client, url: str, body: dict) -> tuple[httpx.Response | None, str | None]:
    """One POST /predict: (the response, None), or (None, why it failed); the body is parsed by the caller
    that needs it, so the timed scenarios pay no JSON decoding."""
    try:
        r = http.post(f"{url}/predict", json=body)
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {e}"
    return (r, None) if r.status_code == 200 else (None, f"{r.status_code}: {r.text[:200]}")


def run_scenario(url: str, bodies: list[dict], requests: int, concurrency: int, deadline: float) -> dict:
    """`requests` POSTs of the bodies in turn from `concurrency` threads: latencies (s) and failures."""
    latencies: list[float] = []
    failures: list[str] = []
    counter = itertools.count()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while (n := next(counter)) < requests + WARMUP * concurrency and time.monotonic() < deadline:
                start = time.perf_counter()
                _, why = post_predict(http, url, bodies[n % len(bodies)])
                elapsed = time.perf_counter() - start
                if n < WARMUP * concurrency:
                    continue  # warm-up: the first requests of a scenario pay for lazy set-up
                with lock:
                    if why is None:
                        latencies.append(elapsed)
                    else:
                        failures.append(why)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"latencies": latencies, "failures": failures, "wall": wall}


def registry(models: list[Path], root: Path) -> tuple[Path, list[str]]:
    """A registry of copies of `models` (store/<sha256 of model.safetensors>), `champion` -> the first."""
    shas = []
    for model in models:
        sha = sha256_file(model / "model.safetensors")  # the name the server verifies a store entry by
        shutil.copytree(model, root / "store" / sha)
        shas.append(sha)
    flip(root / "champion", f"store/{shas[0]}")
    return root / "champion", shas


def flip(link: Path, target: str) -> None:
    """The registry's promotion: a new link beside the old one, renamed over it in one step."""
    tmp = link.with_name(f".{link.name}.flip")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def swap_under_load(url: str, link: Path, shas: list[str], bodies: list[dict], concurrency: int, deadline: float
                    ) -> dict:
    """One-row requests from `concurrency` threads while the champion flips A -> B -> A: each flip waits
    until an answer comes from the new model (bounded by `deadline`)."""
    answers: list[str] = []
    failures: list[str] = []
    stop = threading.Event()
    counter = itertools.count()

    def client() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set() and time.monotonic() < deadline:
                answer, why = post_predict(http, url, bodies[next(counter) % len(bodies)])
                if why is None:
                    answers.append(answer.json()["model"]["sha256"])  # type: ignore[union-attr]
                else:
                    failures.append(why)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    try:
        for target in (shas[1], shas[0]):
            flip(link, f"store/{target}")
            while time.monotonic() < deadline and not (answers and answers[-1] == target):
                time.sleep(0.05)
            seen = len(answers)
            while time.monotonic() < deadline and len(answers) < seen + 20:  # a few more from the new model
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return {"answers": answers, "failures": failures, "wall": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="converted model folder (or a champion link)")
    parser.add_argument("--csv", type=Path, required=True, help="rows to send (the training columns, no label)")
    parser.add_argument("--images-root", type=Path, required=True, help="folder the CSV's image paths are under")
    parser.add_argument("--requests", type=int, default=200, help="counted requests per scenario")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads sending at once")
    parser.add_argument("--max-seconds", type=float, default=600, help="stop the whole run after this long")
    parser.add_argument("--swap-to", type=Path, default=None, help="a second converted model: promoted and rolled "
                        "back while requests run (the last scenario)")
    args = parser.parse_args(argv)
    schema = Predictor.load(args.model).schema  # the columns: which cells are text, which are photos
    rows = json_rows(args.csv, schema.columns.text)
    image_columns = [c for c in schema.columns.image if c in rows[0]]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    log = work / "server.log"
    served, shas = args.model, []
    if args.swap_to is not None:
        served, shas = registry([args.model, args.swap_to], work / "models")
    proc, url = start_server(served, args.images_root, log)
    deadline = time.monotonic() + args.max_seconds
    table = []
    swap = None
    try:
        for per_request, photos in ((1, True), (1, False), (32, True), (32, False)):
            chunks = [rows[i : i + per_request] for i in range(0, len(rows) - per_request + 1, per_request)] or [rows]
            if not photos:
                chunks = [[{**r, **dict.fromkeys(image_columns)} for r in chunk] for chunk in chunks]
            result = run_scenario(url, [{"rows": c} for c in chunks], args.requests, args.concurrency, deadline)
            lat = np.asarray(result["latencies"]) * 1000
            done = len(lat)
            table.append((per_request, "yes" if photos and image_columns else "no", done, len(result["failures"]),
                          done / result["wall"], done * per_request / result["wall"],
                          np.percentile(lat, 50) if done else float("nan"),
                          np.percentile(lat, 99) if done else float("nan")))
            if result["failures"]:
                print(f"first failure ({per_request} rows, photos {photos}): {result['failures'][0]}", file=sys.stderr)
        swap = swap_under_load(url, served, shas, [{"rows": [r]} for r in rows], args.concurrency, deadline) \
            if shas else None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"\n{args.model} ({url}), concurrency {args.concurrency}, {os.cpu_count()} CPUs")
    print("| rows/request | photos | requests | failed | requests/s | rows/s | p50 ms | p99 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, photos, done, failed, rps, rows_s, p50, p99 in table:
        print(f"| {n} | {photos} | {done} | {failed} | {rps:.1f} | {rows_s:.1f} | {p50:.1f} | {p99:.1f} |")
    if swap is not None:
        by_model = {sha[:12]: swap["answers"].count(sha) for sha in shas}
        other = len(swap["answers"]) - sum(by_model.values())
        print(f"\nswap under load (A {shas[0][:12]} -> B {shas[1][:12]} -> A, one-row requests, {args.concurrency} "
              f"clients): {len(swap['answers'])} answered in {swap['wall']:.1f} s, {len(swap['failures'])} failed, "
              f"answers per model {by_model}, from any other model {other}")
        if swap["failures"]:
            print(f"first failure: {swap['failures'][0]}", file=sys.stderr)
    if time.monotonic() >= deadline:
        print(f"(stopped at --max-seconds {args.max_seconds:g}: fewer requests than asked)")
    swap_failed = swap is not None and (swap["failures"] or set(swap["answers"]) - set(shas))
    return 1 if any(row[3] for row in table) or swap_failed else 0


if __name__ == "__main__":
    sys.exit(main())

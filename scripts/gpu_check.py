"""The Python half of scripts/gpu_check.sh: builds the BERT-style text models, samples GPU memory and listening
sockets while a run trains, converts and predicts each run, and writes the report ($OUT/gpu_check.json).

    python scripts/gpu_check.py text-models DATA_DIR DIR=HIDDENxLAYERS ...
    python scripts/gpu_check.py sample OUT_JSON STOP_FILE [--gpu]
    python scripts/gpu_check.py post CHECKPOINT_DIR MODEL_DIR DATA_DIR OUT_JSON [--timeout-s S]
    python scripts/gpu_check.py run-record OUT_JSON KEY=VALUE ...
    python scripts/gpu_check.py listeners [--json]
    python scripts/gpu_check.py report RESULT WORK

Nothing here is imported by the project or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny_text_model and tests.validated_tables, fusion_model unpackaged

MEMORY_METHOD = (
    "gpu_peak_used_mib: the highest memory.used of each GPU that `nvidia-smi --query-gpu=index,memory.used "
    "-lms 200` printed while the run trained (device-wide: every process on the GPU, its CUDA context and "
    "the memory PyTorch's caching allocator reserved, not only what tensors held; a peak shorter than "
    "200 ms can be missed); gpu_idle_used_mib: the same before the first run. rank_memory: each rank's "
    "parameter, gradient and optimizer bytes at the end of training and its peak resident (host) memory, "
    "from train_summary.json when the project records them. Conversion and prediction run on the CPU with "
    "the GPU hidden (CUDA_VISIBLE_DEVICES=''), overlapping the next run's training, so they add nothing to "
    "the GPU numbers."
)


def _tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- text models ---------------------------------------------------------------------------------------
def text_models(data_dir: Path, specs: list[str]) -> None:
    """Each DIR=HIDDENxLAYERS: a BERT-style folder (WordPiece vocabulary trained on the table's text
    columns, random weights) built offline by tests/tiny_text_model.py."""
    import pandas as pd
    from transformers.utils import logging as hf_logging

    from tests.tiny_text_model import make_text_model

    hf_logging.disable_progress_bar()
    meta = json.loads((data_dir / "meta.json").read_text())
    columns = meta["schema"]["columns"]["text"]
    train = pd.read_parquet(data_dir / "train.parquet", columns=columns)
    texts = train[columns].fillna("").astype(str).agg(" ".join, axis=1).tolist()
    for spec in specs:
        folder, size = spec.split("=")
        hidden, layers = (int(x) for x in size.lower().split("x"))
        started = time.perf_counter()
        make_text_model(Path(folder), texts, hidden=hidden, layers=layers)
        weights = Path(folder) / "model.safetensors"
        print(f"text model {folder}: hidden {hidden}, {layers} layers, {weights.stat().st_size / 2**20:.1f} MiB "
              f"of weights, built in {time.perf_counter() - started:.1f} s")


# ---- listening sockets -----------------------------------------------------------------------------------
_SS_USER = re.compile(r'\("([^"]+)",pid=(\d+)')


def _loopback(local: str) -> bool:
    host = local.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "localhost") or host.startswith("::ffff:127.")


def listening() -> tuple[list[dict[str, Any]], str]:
    """TCP sockets in LISTEN: [{local, process, pids, loopback}] and the raw text (`ss -ltnp`, or psutil's
    view where ss is not installed); ([], the error) where neither can read them."""
    try:
        return _listening()
    except Exception as e:
        return [], f"listening sockets unreadable: {type(e).__name__}: {e}"


def _listening() -> tuple[list[dict[str, Any]], str]:
    rows: list[dict[str, Any]] = []
    if shutil.which("ss"):
        raw = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=10).stdout
        for line in raw.splitlines()[1:]:
            parts = line.split()
            if len(parts) < 5:
                continue
            users = _SS_USER.findall(" ".join(parts[5:]))
            rows.append({"local": parts[3], "process": ",".join(sorted({n for n, _ in users})) or None,
                         "pids": sorted({int(p) for _, p in users}), "loopback": _loopback(parts[3])})
        return rows, raw
    import psutil

    lines = ["(ss not installed: psutil.net_connections)"]
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        local = f"[{conn.laddr.ip}]:{conn.laddr.port}" if ":" in conn.laddr.ip else f"{conn.laddr.ip}:{conn.laddr.port}"
        name = None
        if conn.pid:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.Error:
                pass
        rows.append({"local": local, "process": name, "pids": [conn.pid] if conn.pid else [],
                     "loopback": _loopback(local)})
        lines.append(f"LISTEN {local} {name or ''} pid={conn.pid}")
    return rows, "\n".join(lines)


def _key(row: dict[str, Any]) -> str:
    return f"{row['local']} {row['process']}"


# ---- sampling while a run trains -------------------------------------------------------------------------
def _tree(pid: int) -> set[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return set()


def sample(out: Path, stop: Path, gpu: bool, pid: int | None) -> None:
    """Until STOP exists: each GPU's memory.used every 200 ms (nvidia-smi's own loop) and, every second, the
    listening TCP sockets of process PID and its descendants (all of them without PID); then the peaks and
    the sockets seen, as JSON."""
    csv = out.with_suffix(".smi.csv")
    smi = None
    if gpu and shutil.which("nvidia-smi"):
        with csv.open("w") as sink:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                    "-lms", "200"], stdout=sink, stderr=subprocess.DEVNULL)
    seen: dict[str, dict[str, Any]] = {}
    next_ss = 0.0
    while not stop.exists():
        if time.monotonic() >= next_ss:
            next_ss = time.monotonic() + 1.0
            own = _tree(pid) if pid else set()
            for row in listening()[0]:
                if pid is None or own.intersection(row["pids"]):
                    seen.setdefault(_key(row), row)
        time.sleep(0.2)
    if smi is not None:
        smi.terminate()
        try:
            smi.wait(timeout=5)
        except subprocess.TimeoutExpired:
            smi.kill()
    peaks: dict[str, int] = {}
    samples = 0
    if csv.exists():
        for line in csv.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[1].isdigit():
                samples += 1
                peaks[parts[0]] = max(peaks.get(parts[0], 0), int(parts[1]))
    out.write_text(json.dumps({"gpu_peak_used_mib": peaks or None, "gpu_samples": samples,
                               "listeners": list(seen.values())}, indent=2))


# ---- conversion and prediction ---------------------------------------------------------------------------
def post(checkpoint_dir: Path, model_dir: Path, data_dir: Path, out: Path, timeout_s: float) -> None:
    """`python -m tasks convert` on the run's checkpoint, then Predictor.load(MODEL_DIR).predict_proba on
    the test table; both results (or their errors) as JSON."""
    result: dict[str, Any] = {"convert": {"ok": False}, "predict": {"ok": False}}
    log = out.with_suffix(".convert.log")
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "tasks", "convert", "--params", "params.yaml",
           "--checkpoint-dir", str(checkpoint_dir), "--out-dir", str(model_dir)]
    result["convert"]["command"] = " ".join(cmd[1:])
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        import numpy as np  # what prediction needs, imported while the conversion runs
        import pandas as pd

        from fusion_model.predict import Predictor
    except Exception as e:
        result["predict"]["error"] = f"import: {type(e).__name__}: {e}"
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        proc.terminate()
        rc = proc.wait()
        result["convert"]["error"] = f"timed out after {timeout_s:.0f} s"
    conv = result["convert"]
    conv.update({"exit_code": rc, "wall_s": round(time.perf_counter() - started, 1)})
    manifest = _read_json(model_dir / "manifest.json") if rc == 0 else None  # fusion_model.layout's name
    if rc == 0 and manifest:
        output = manifest.get("output", {})
        conv.update({"ok": True, "parameters": output.get("parameters"), "bytes": output.get("bytes"),
                     "tensors": output.get("tensors"), "dtype": output.get("dtype"),
                     "task_seconds": manifest.get("seconds"), "source_kind": manifest.get("source", {}).get("kind"),
                     "zero_stage": manifest.get("source", {}).get("zero_stage")})
    else:
        conv["log_tail"] = _tail(log)
    if conv["ok"] and "error" not in result["predict"]:
        pred = result["predict"]
        started = time.perf_counter()
        try:
            predictor = Predictor.load(model_dir)
            test = pd.read_parquet(data_dir / "test.parquet")
            meta = json.loads((data_dir / "meta.json").read_text())
            proba = predictor.predict_proba(test, (data_dir / meta["dataset_root"]).resolve())
            finite = bool(np.isfinite(proba).all())
            sums = bool(np.allclose(proba.sum(axis=1), 1.0, atol=1e-4))
            pred.update({"ok": proba.shape == (len(test), len(meta["classes"])) and finite and sums,
                         "rows": int(proba.shape[0]), "classes": int(proba.shape[1]), "finite": finite,
                         "rows_sum_to_1": sums, "mean_proba": [round(float(v), 4) for v in proba.mean(axis=0)],
                         "wall_s": round(time.perf_counter() - started, 2)})
        except Exception as e:  # recorded, the check goes on
            pred["error"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result, indent=2))


# ---- the report ------------------------------------------------------------------------------------------
def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def run_record(out: Path, pairs: list[str]) -> None:
    record = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        record[key] = _value(value)
    out.write_text(json.dumps(record, indent=2))


def _run_entry(name: str, record: dict[str, Any], work: Path, expected_accelerator: str) -> dict[str, Any]:
    entry: dict[str, Any] = {k: record.get(k) for k in ("strategy", "zero_stage", "precision", "image_model",
                                                        "image_size", "text_model", "text_max_tokens", "steps_asked")}
    train: dict[str, Any] = {"exit_code": record.get("exit_code"), "wall_s": record.get("wall_s"),
                             "limit_s": record.get("limit_s"), "command": record.get("command")}
    summary = _read_json(work / "ckpt" / name / "train_summary.json")
    train_ok = record.get("exit_code") == 0 and summary is not None
    if summary:
        train.update({"it_per_s": summary.get("steps_per_s"), "samples_per_s": summary.get("samples_per_s"),
                      "world_size": summary.get("world_size"), "steps": summary.get("steps"),
                      "accelerator": summary.get("accelerator"), "precision": summary.get("precision"),
                      "best_val_auc": summary.get("best_score"), "fit_wall_s": summary.get("fit_wall_s"),
                      "deepspeed_parsed": summary.get("deepspeed_parsed")})
        train_ok = train_ok and summary.get("accelerator") == expected_accelerator and bool(summary.get("steps"))
        if summary.get("memory") is not None:
            entry["rank_memory"] = summary["memory"]
    if not train_ok:
        train["log_tail"] = _tail(work / "logs" / f"train_{name}.log")
    train["ok"] = train_ok
    entry["train"] = train
    sampled = _read_json(work / "samples" / f"{name}.json") or {}
    entry["gpu_peak_used_mib"] = sampled.get("gpu_peak_used_mib")
    entry["gpu_samples"] = sampled.get("gpu_samples")
    # sockets the run's own processes listened on (the train command and its descendants), sampled each second
    entry["listeners_during_training"] = sampled.get("listeners", [])
    post_result = _read_json(work / "post" / f"{name}.json")
    if post_result is None:
        post_result = {"convert": {"ok": False, "error": "not run" if not train_ok else
                                   "no result (the conversion or prediction was cut by the budget)"},
                       "predict": {"ok": False}}
    entry.update(post_result)
    entry["ok"] = bool(train_ok and entry["convert"].get("ok") and entry["predict"].get("ok"))
    return entry


def _mib(n: Any) -> str:
    return f"{n / 2**20:.0f}" if isinstance(n, int | float) else "-"


def report(result: Path, work: Path) -> int:
    env = _read_json(work / "env.json") or {}
    expected = "cuda" if env.get("mode") == "cuda" else "cpu"
    order = (work / "runs_order.txt").read_text().split() if (work / "runs_order.txt").exists() else []
    runs: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in order:
        record = _read_json(work / "runs" / f"{name}.json") or {}
        if record.get("skipped"):
            skipped[name] = record["skipped"]
            continue
        runs[name] = _run_entry(name, record, work, expected)
    at_end, raw = listening()
    started = env.get("started_at_epoch")
    report = {
        "ok": bool(runs) and not skipped and all(r["ok"] for r in runs.values()),
        **{k: v for k, v in env.items() if k != "started_at_epoch"},
        "elapsed_s": round(time.time() - started, 1) if started else None,
        "memory_method": MEMORY_METHOD,
        "gpu_idle_used_mib": (_read_json(work / "gpu_idle.json") or {}).get("gpu_peak_used_mib"),
        "runs": runs,
        "skipped": skipped,
        "listening_at_start": _read_json(work / "listeners_start.json"),
        "listening_at_end": at_end,
        "listening_at_end_raw": raw,
    }
    result.write_text(json.dumps(report, indent=2))
    print(f"\nlistening TCP sockets at the end ({'ss -ltnp' if shutil.which('ss') else 'psutil'}):")
    print(raw.rstrip() or "(none)")
    print(f"\nper run ({expected}, {env.get('precision')} unless the name says otherwise, batch "
          f"{env.get('per_device_batch')} per device; GPU peak = nvidia-smi memory.used, sampled every 200 ms):")
    head = f"  {'run':<20}{'it/s':>8}{'samples/s':>11}{'GPU peak MiB':>14}{'params':>12}{'fp32 MiB':>10}" \
           f"{'convert s':>11}  predict"
    print(head)
    for name, r in runs.items():
        t, c, p = r["train"], r["convert"], r["predict"]
        peaks = r.get("gpu_peak_used_mib") or {}
        peak = "/".join(str(v) for _, v in sorted(peaks.items())) or "-"
        its = f"{t['it_per_s']:.2f}" if t.get("it_per_s") else "-" if t.get("ok") else "FAILED"
        sps = f"{t['samples_per_s']:.3g}" if t.get("samples_per_s") else "-"
        params = f"{c['parameters'] / 1e6:.1f}M" if c.get("parameters") else "-"
        pred = f"ok ({p['rows']} rows)" if p.get("ok") else f"FAILED {p.get('error', '')}"[:60]
        conv = f"{c['wall_s']}" if c.get("ok") else "FAILED"
        if not t.get("ok"):
            pred, conv = "not run", "-"
        print(f"  {name:<20}{its:>8}{sps:>11}{peak:>14}{params:>12}{_mib(c.get('bytes')):>10}{conv:>11}  {pred}")
        heard = r.get("listeners_during_training") or []
        if heard:
            wide = [f"{x['local']} {x['process'] or ''}".strip() for x in heard if not x["loopback"]]
            names = ", ".join(sorted({x["process"] or "?" for x in heard}))
            where = f"NOT ON LOOPBACK: {', '.join(wide)}" if wide else "all on loopback"
            print(f"  {'':<20}while it trained its processes listened on {len(heard)} TCP socket(s) ({names}): {where}")
    for name, why in skipped.items():
        print(f"  {name:<20}skipped: {why}")
    print("ok" if report["ok"] else "NOT ok", "->", result)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("text-models")
    p.add_argument("data_dir", type=Path)
    p.add_argument("specs", nargs="+")
    p = sub.add_parser("sample")
    p.add_argument("out", type=Path)
    p.add_argument("stop", type=Path)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--pid", type=int, default=None)
    p = sub.add_parser("post")
    p.add_argument("checkpoint_dir", type=Path)
    p.add_argument("model_dir", type=Path)
    p.add_argument("data_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--timeout-s", type=float, default=150.0)
    p = sub.add_parser("run-record")
    p.add_argument("out", type=Path)
    p.add_argument("pairs", nargs="*")
    p = sub.add_parser("listeners")
    p.add_argument("--json", type=Path, default=None)
    p = sub.add_parser("report")
    p.add_argument("result", type=Path)
    p.add_argument("work", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "text-models":
        text_models(args.data_dir, args.specs)
    elif args.cmd == "sample":
        sample(args.out, args.stop, args.gpu, args.pid)
    elif args.cmd == "post":
        post(args.checkpoint_dir, args.model_dir, args.data_dir, args.out, args.timeout_s)
    elif args.cmd == "run-record":
        run_record(args.out, args.pairs)
    elif args.cmd == "listeners":
        rows, raw = listening()
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        print(raw.rstrip())
    elif args.cmd == "report":
        return report(args.result, args.work)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

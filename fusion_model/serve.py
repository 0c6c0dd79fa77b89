"""A local HTTP endpoint for the champion model (FastAPI + uvicorn).

``python -m fusion_model.serve --model models/champion [--host 127.0.0.1] [--port 8000] [--images-root DIR]``

- ``POST /predict``: ``{"rows": [{column: value, ...}, ...]}`` (image cells: paths relative to --images-root,
  or ``{"base64": "..."}``; see fusion_model/serve_rows.py) -> ``{"model": {"version", "sha256"},
  "predictions": [{id, prediction, score?, proba_<class>...}, ...]}``, the same values as
  ``Predictor.predict`` on those rows.
- ``GET /health``: ok and the loaded model's version and sha256.
- ``GET /model``: version, sha256, the metrics kept beside the model, its dataset schema, the watch state.

A champion link is watched and swapped without a restart (fusion_model/model_watch.py): every answer comes
from one whole model and names it. Bad input is a 400/422 naming the field and the reason; a failure of the
server itself is a 500 with a message, and the server keeps serving. There is no authentication: it binds
to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from fusion_model.dataset import split_images
from fusion_model.model_watch import LoadedModel, ModelWatcher
from fusion_model.serve_rows import FROM_ROOT, RequestError, RequestRows, parse_body, problem, request_rows

log = logging.getLogger("fusion_model.serve")
MAX_BODY_BYTES = 256 * 1024 * 1024  # a request of 4096 rows with a photo each fits; more is a client's mistake
# lines of the predictor's refusal (fusion_model/checks.py check_prediction_rows), to name each field
_ROW_COLUMN = re.compile(r"^\s*row (\d+), column '(.+?)': (.*)$")
_ROW_FILE = re.compile(r"^\s*row (\d+), file (.+?): (.*)$")


def refusal_problems(message: str, rows: RequestRows, image_columns: list[str]) -> list[dict[str, Any]]:
    """The predictor's refusal as one problem per row and field (the whole text when no line parses)."""
    out = []
    for line in message.splitlines():
        if m := _ROW_COLUMN.match(line):
            out.append(problem(["rows", int(m[1]), m[2]], m[3], "value_refused"))
        elif m := _ROW_FILE.match(line):
            i, path, why = int(m[1]), m[2], m[3]
            if path in rows.uploads:
                out.append(problem(["rows", i, rows.uploads[path][1]], f"base64 photo: {why}", "image_refused"))
                continue
            col = next((c for c in image_columns if path in split_images(rows.frame.at[i, c])), None)
            shown = path.removeprefix(f"{FROM_ROOT}/")
            out.append(problem(["rows", i, *([col] if col else [])], f"image {shown!r}: {why}", "image_refused"))
    return out or [problem(["rows"], message, "rows_refused")]


def _records(frame: Any) -> list[dict[str, Any]]:
    """Prediction rows as JSON objects; a non-finite number (none is expected) becomes null, not invalid JSON."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
            for rec in frame.to_dict(orient="records")]


def score(model: LoadedModel, rows: list[Any], images_root: Path | None) -> dict[str, Any]:
    """The answer to /predict from `model` alone (the caller took it once for this request)."""
    predictor = model.predictor
    parsed = request_rows(rows, predictor.schema, images_root)
    try:
        frame = predictor.predict(parsed.frame, parsed.images_root)
    except ValueError as e:  # PredictError, PreprocessError, the row checks: the input, not the server
        image_columns = [c for c in predictor.schema.columns.image if c in parsed.frame.columns]
        fix = next((line for line in str(e).splitlines() if line.startswith("Fix:")), None)
        raise RequestError(422, refusal_problems(str(e), parsed, image_columns), fix) from None
    finally:
        parsed.close()
    return {"model": model.names(), "predictions": _records(frame)}


def _internal_error(e: BaseException) -> JSONResponse:
    return JSONResponse(status_code=500, content={
        "detail": [{"loc": [], "msg": f"internal error ({type(e).__name__}: {e})", "type": "internal"}],
        "message": "the server failed on this request and is still serving; its log has the traceback"})


def create_app(watcher: ModelWatcher, images_root: Path | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        watcher.start()
        yield
        watcher.stop()

    app = FastAPI(title="fusion_model", summary="Predict rows with the champion model", lifespan=lifespan)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _internal_error(exc)

    @app.get("/health")
    def health() -> dict[str, Any]:
        watcher.poke()
        return {"status": "ok", **watcher.current.names()}

    @app.get("/model")
    def model() -> dict[str, Any]:
        watcher.poke()
        m = watcher.current
        return {**m.names(), "version_source": m.version_source, "folder": str(m.folder), "loaded_at": m.loaded_at,
                "problem_type": m.predictor.problem_type, "classes": m.predictor.classes, "metrics": m.metrics,
                "dataset": m.predictor.config.get("dataset"), "images_root": str(images_root) if images_root else None,
                "watch": watcher.describe()}

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        model = watcher.current  # taken once: the whole answer comes from this model, whatever swaps meanwhile
        watcher.poke()
        raw = await request.body()
        try:
            if len(raw) > MAX_BODY_BYTES:
                raise RequestError(413, [problem([], f"the body has {len(raw)} bytes, more than {MAX_BODY_BYTES}; "
                                                     "send fewer rows per request", "too_large")])
            rows = parse_body(raw)
            # model inference and image decoding block: a worker thread keeps the event loop answering
            return JSONResponse(await run_in_threadpool(score, model, rows, images_root))
        except RequestError as e:
            return JSONResponse(status_code=e.status, content=e.body())
        except Exception as e:  # anything else is the server's fault: say so, keep serving
            log.exception("POST /predict failed")
            return _internal_error(e)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_model.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/champion"),
                        help="converted model folder, or the registry's champion link (watched and hot-swapped)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (no authentication: keep it local)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--images-root", type=Path, default=None,
                        help="folder that image paths in requests are relative to (without it: base64 photos only)")
    parser.add_argument("--watch-interval", type=float, default=1.0, help="seconds between checks of the link")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.images_root is not None and not args.images_root.is_dir():
        print(f"error: serve: --images-root {args.images_root} is not a folder; pass the dataset folder the "
              "image paths are relative to", file=sys.stderr)
        return 1
    try:
        watcher = ModelWatcher(args.model, interval=args.watch_interval)
    except (OSError, ValueError) as e:  # PredictError and a missing folder
        print(f"error: serve: cannot load {args.model}: {e}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: anyone who can reach it can use the model (there is no authentication)", args.host)
    import uvicorn

    m = watcher.current
    log.info("serving version %s (%s) from %s on http://%s:%d", m.version, m.sha256[:12], m.folder, args.host,
             args.port)
    uvicorn.run(create_app(watcher, args.images_root), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

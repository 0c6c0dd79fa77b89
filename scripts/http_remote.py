"""A DVC HTTP remote for the machines of a demo or test: files under one folder, over HTTP on one address.

DVC's `http` remote reads with GET/HEAD and writes with POST (or PUT): this serves exactly that, on the
address it is given (never every interface), with aiohttp (already installed as dvc-http's client). A
write goes to a temporary file and is renamed into place, so a reader never sees half a file. Not for
production: a real cluster uses an object store, SSH or WebDAV remote; the project's code is the same.

    python scripts/http_remote.py --root DIR --host 198.18.0.1 [--port 0] [--port-file FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import uuid
from pathlib import Path

from aiohttp import web


def _target(root: Path, tail: str) -> Path | None:
    path = (root / tail).resolve()
    return path if path.is_relative_to(root) and path != root else None


def make_app(root: Path) -> web.Application:
    root = root.resolve()

    async def read(request: web.Request) -> web.StreamResponse:
        path = _target(root, request.match_info["tail"])
        if path is None or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def write(request: web.Request) -> web.Response:
        path = _target(root, request.match_info["tail"])
        if path is None:
            raise web.HTTPForbidden()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                async for chunk in request.content.iter_chunked(1 << 20):
                    f.write(chunk)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return web.Response(status=201)

    app = web.Application(client_max_size=0)
    app.router.add_route("GET", "/{tail:.+}", read)  # aiohttp answers HEAD through the GET route
    app.router.add_route("POST", "/{tail:.+}", write)
    app.router.add_route("PUT", "/{tail:.+}", write)
    return app


async def serve(root: Path, host: str, port: int, port_file: Path | None) -> None:
    runner = web.AppRunner(make_app(root), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if port_file is not None:
        port_file.write_text(f"{bound}\n")
    print(f"serving {root} at http://{host}:{bound}/", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port here once serving")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(args.root, args.host, args.port, args.port_file))


if __name__ == "__main__":
    main()

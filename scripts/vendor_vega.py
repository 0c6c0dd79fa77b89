"""Ship the Vega scripts `dvc plots show` needs inside one offline HTML template (vendor/vega/).

DVC's own page loads Vega, Vega-Lite and vega-embed from a CDN, so it stays blank without network. This
script takes the three packages' browser builds from the npm registry (`npm pack`: run by whoever updates
them, never when plots are drawn) and writes:

- vendor/vega/dvc_plots.html: DVC's page with the three builds inlined and their licences in a comment,
  the template `.dvc/config` names (`plots.html_template`): `dvc plots show` / `diff` then write a page
  that loads no script from the network;
- vendor/vega/LICENSES.txt: the BSD-3-Clause licences of the three, and the licences of the packages their
  builds bundle (the d3 modules and others), each with its name and version;
- vendor/vega/README.md: what is there, the versions, each build's sha256.

    python scripts/vendor_vega.py          # needs npm and its registry; rewrites vendor/vega/
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "vendor" / "vega"
TEMPLATE = "dvc_plots.html"
# the versions DVC's own page loads are older (vega 5.20, vega-lite 5.2, vega-embed 6.18); these are the
# newest of the same major versions, which draw DVC's Vega-Lite v5 specs
VERSIONS = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}
BUILDS = {"vega": "build/vega.min.js", "vega-lite": "build/vega-lite.min.js", "vega-embed": "build/vega-embed.min.js"}
# The vega package carries no LICENSE file: its repository's licence is the one each of its packages carries.
LICENSE_OF = {"vega": "vega-crossfilter"}
# Installed with the three but in none of their browser builds: command-line tools and their arguments
# parsing, Node's fetch, type declarations, a build tool's native binary.
NODE_ONLY = {
    "@rollup/rollup-linux-x64-gnu", "@types/estree", "@types/geojson", "ansi-regex", "ansi-styles", "cliui",
    "color-convert", "color-name", "commander", "emoji-regex", "escalade", "get-caller-file", "iconv-lite",
    "is-fullwidth-code-point", "node-fetch", "require-directory", "rw", "safer-buffer", "string-width",
    "strip-ansi", "tr46", "vega-typings", "webidl-conversions", "whatwg-url", "wrap-ansi", "y18n", "yargs",
    "yargs-parser",
}
PLACEHOLDERS = ("{plot_divs}", "{scripts}", "{refresh_tag}")


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def _license_text(package: Path) -> str | None:
    found = sorted(p for p in package.iterdir() if p.name.lower().startswith(("license", "licence")))
    return found[0].read_text().strip() if found else None


def _packages(work: Path) -> dict[str, Path]:
    """Every package `npm install` put beside the three, by name (scoped ones as @scope/name)."""
    modules = work / "node_modules"
    found = {}
    for entry in sorted(modules.iterdir()):
        for package in sorted(entry.iterdir()) if entry.name.startswith("@") else [entry]:
            if (package / "package.json").is_file():
                found[package.relative_to(modules).as_posix()] = package
    return found


def _licenses(packages: dict[str, Path]) -> str:
    """LICENSES.txt: the three first, then the bundled packages grouped by identical licence text."""
    texts: dict[str, list[str]] = {}
    for name, package in packages.items():
        if name in NODE_ONLY:
            continue
        meta = json.loads((package / "package.json").read_text())
        text = _license_text(packages[LICENSE_OF.get(name, name)])
        if text is None:  # the vega repository's packages that ship no file: its licence (the same BSD-3)
            text = _license_text(packages["vega-crossfilter"]) if name.startswith("vega") else None
        if text is None:
            sys.exit(f"{name}: no licence file and no rule for it; add one to scripts/vendor_vega.py")
        texts.setdefault(text, []).append(f"{name} {meta['version']} ({meta.get('license')})")
    lines = [
        "Licences of the scripts inlined in vendor/vega/dvc_plots.html (scripts/vendor_vega.py).",
        "",
        f"Vega {VERSIONS['vega']}, Vega-Lite {VERSIONS['vega-lite']} and vega-embed {VERSIONS['vega-embed']} are "
        "distributed under the BSD-3-Clause licence; their builds bundle the other packages named below, each "
        "under the licence printed after its name.",
    ]
    for text, names in sorted(texts.items(), key=lambda kv: (not any(n.split()[0] in VERSIONS for n in kv[1]),
                                                             kv[1][0])):
        lines += ["", "=" * 100, *names, "-" * 100, text]
    return "\n".join(lines) + "\n"


def _page(builds: dict[str, str], notices: str) -> str:
    for name, code in builds.items():
        for bad in ("</script", "<!--", *PLACEHOLDERS):
            if bad in code:
                sys.exit(f"{name}: its build holds {bad!r}, which would break the inlined page")
    if "--" in notices:
        sys.exit("a licence text holds '--', which would end the page's comment early")
    scripts = "".join(f"    <script>/* {name} {VERSIONS[name]} */\n{code}\n    </script>\n"
                      for name, code in builds.items())
    return ("<!DOCTYPE html>\n<html>\n<head>\n    {refresh_tag}\n    <meta charset=\"utf-8\">\n"
            "    <title>DVC Plot</title>\n<!--\n" + notices + "\n-->\n" + scripts
            + "    <style>\n        table {\n            border-spacing: 15px;\n        }\n    </style>\n"
            "</head>\n<body>\n    {plot_divs}\n</body>\n</html>\n")


def main() -> None:
    if shutil.which("npm") is None:
        sys.exit("npm not found: install Node.js and npm (the script takes the packages from the npm registry)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        specs = [f"{n}@{v}" for n, v in VERSIONS.items()]
        (work / "package.json").write_text('{"name": "vendor-vega", "private": true}\n')
        _run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--no-save", *specs], work)
        builds, digests = {}, {}
        for name in VERSIONS:
            tarball = work / _run(["npm", "pack", "--silent", f"{name}@{VERSIONS[name]}"], work).strip().splitlines()[-1]
            with tarfile.open(tarball) as archive:
                raw = archive.extractfile(f"package/{BUILDS[name]}").read()
            builds[name], digests[name] = raw.decode().strip(), hashlib.sha256(raw).hexdigest()
        packages = _packages(work)
        licenses = _licenses(packages)
        notices = "\n\n".join(
            f"{name} {VERSIONS[name]}, BSD-3-Clause:\n\n{_license_text(packages[LICENSE_OF.get(name, name)])}"
            for name in VERSIONS)
        notices = ("Vega, Vega-Lite and vega-embed, inlined so that this page loads no script from the network "
                   "(scripts/vendor_vega.py). Their licences follow; those of the packages their builds bundle "
                   "are in vendor/vega/LICENSES.txt.\n\n" + notices)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / TEMPLATE).write_text(_page(builds, notices))
    (OUT / "LICENSES.txt").write_text(licenses)
    sums = "\n".join(f"| {n} | {VERSIONS[n]} | `{BUILDS[n]}` | `{digests[n]}` |"
                     for n in VERSIONS)
    (OUT / "README.md").write_text(
        "# vendor/vega: `dvc plots show` without network\n\n"
        f"`{TEMPLATE}` is DVC's plots page with the Vega scripts inlined, so the page `dvc plots show` and `dvc "
        "plots diff` write loads no script from the network; `.dvc/config` names it (`plots.html_template`). "
        "`LICENSES.txt`: the licences of the inlined scripts (BSD-3-Clause) and of the packages their builds "
        "bundle. Written by `python scripts/vendor_vega.py` from the npm packages below (change the versions "
        "there and run it again to update them); docs/dvc.md tells how the page was checked.\n\n"
        "| package | version | build inlined | sha256 of the build |\n|---|---|---|---|\n" + sums + "\n")
    print(f"wrote {OUT / TEMPLATE} ({(OUT / TEMPLATE).stat().st_size // 1024} KiB), LICENSES.txt, README.md")


if __name__ == "__main__":
    main()

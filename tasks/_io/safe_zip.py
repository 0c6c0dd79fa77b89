"""Extract a downloaded zip only after every member has been checked.

Refused before anything is written: members with absolute paths, members whose path leaves the target
folder (zip-slip, ``../``), symbolic links, and archives that would unpack to more than
``MAX_UNPACKED_BYTES``. A truncated, damaged or non-zip file fails with the file's name and size.
"""

from __future__ import annotations

import re
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from tasks.errors import StageError

MAX_UNPACKED_BYTES = 20 * 2**30  # the tutorial zip unpacks to ~20 MB; anything near this is a zip bomb

_DRIVE = re.compile(r"^[A-Za-z]:")


def safe_extract(archive: Path, target: Path) -> list[str]:
    """Extract `archive` into the folder `target` (created); return the member names."""
    archive, target = Path(archive), Path(target)
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise StageError(
            f"{archive}: not a readable zip archive ({archive.stat().st_size} bytes: {e}). The download is "
            "truncated or the URL does not serve a zip; check download.url and run the stage again."
        ) from None
    with zf:
        infos = zf.infolist()
        if not infos:
            raise StageError(f"{archive}: the zip archive is empty; check download.url.")
        target.mkdir(parents=True, exist_ok=True)
        root = target.resolve()
        for info in infos:
            reason = _unsafe_reason(info, root)
            if reason:
                raise StageError(
                    f"{archive}: member {info.filename!r} {reason}; refusing to extract anything from this "
                    "archive. Download it again from a trusted source (check download.url and download.sha256)."
                )
        unpacked = sum(i.file_size for i in infos)
        if unpacked > MAX_UNPACKED_BYTES:
            raise StageError(
                f"{archive}: members would unpack to {unpacked} bytes (limit {MAX_UNPACKED_BYTES}); "
                "refusing a likely zip bomb. Check download.url."
            )
        try:
            zf.extractall(root)
        except (zipfile.BadZipFile, EOFError, zlib.error, OSError) as e:
            raise StageError(
                f"{archive}: damaged zip archive, extraction failed ({e}). Run the stage again to download "
                "it afresh; if it keeps failing, the file at download.url is broken."
            ) from None
    return [i.filename for i in infos]


def _unsafe_reason(info: zipfile.ZipInfo, root: Path) -> str | None:
    name = info.filename
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        return "has an absolute path"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "escapes the target folder (a '..' path component: zip-slip)"
    if not (root / name).resolve().is_relative_to(root):
        return "escapes the target folder (zip-slip)"
    # Unix file type bits, when the archiver recorded them (0 = none recorded: a plain file).
    kind = stat.S_IFMT(info.external_attr >> 16)
    if kind == stat.S_IFLNK:
        return "is a symbolic link"
    if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "is not a regular file or folder"
    return None

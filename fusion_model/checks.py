"""Row checks shared by validation and prediction: pure pandas and PIL, no Great Expectations.

Each check returns one boolean column per rule, indexed like its input, so the validate stage can hand
the columns to GX ("expect all true") and the predictor can refuse bad rows before inference with the
same rules. Image checks return nullable booleans: a rule that could not be evaluated for a row (no
image paths, or a path already unsafe so the file is never touched) is <NA>, not a second failure.
"""

from __future__ import annotations

import multiprocessing
import os
import posixpath
import stat
from collections.abc import Iterable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from PIL import Image

from fusion_model.dataset import CodeRange, DatasetSchema, canonical, split_images

# Derived per-row columns (the names the validation suite expects to be true).
PATHS_SAFE = "image_paths_safe"
IMAGES_EXIST = "images_exist"
IMAGES_DECODE = "images_decode"
IMAGE_ISSUE = "image_issue"  # the first bad file of the row and why ("" when none)
IMAGE_CHECK_COLUMNS: tuple[str, ...] = (PATHS_SAFE, IMAGES_EXIST, IMAGES_DECODE)
IMAGE_CELLS = "image_cells"  # every photo of a row, all image columns joined (';'-separated)


def to_numbers(values: pd.Series) -> pd.Series:
    """Numbers as float64; empty cells and anything that is not a number become NaN."""
    if pd.api.types.is_bool_dtype(values):
        return pd.Series(float("nan"), index=values.index)
    return pd.to_numeric(values, errors="coerce").astype("float64")


def is_empty(values: pd.Series) -> pd.Series:
    return values.isna() | (values.astype("str").str.strip() == "")


def not_a_number(values: pd.Series) -> pd.Series:
    """Per row: a cell that holds something that is not a number (an empty cell is not this problem)."""
    return to_numbers(values).isna() & ~is_empty(values)


def image_cells(df: pd.DataFrame, image_columns: Iterable[str]) -> pd.Series:
    """Every photo a row names, over all image columns, as one ';'-separated cell ("" for none)."""
    columns = [c for c in image_columns if c in df.columns]
    if not columns:
        return pd.Series("", index=df.index, dtype="str")
    paths = [df[c].map(split_images) for c in columns]
    joined = paths[0]
    for more in paths[1:]:
        joined = joined + more
    return joined.map(";".join).astype("str")


def code_meaning(schema: DatasetSchema, column: str) -> str:
    codes = schema.checks.codes[column]
    if isinstance(codes, CodeRange):
        return f"{codes.min:g}-{codes.max:g}" + (f": {codes.meaning}" if codes.meaning else "")
    shown = ", ".join(map(str, codes[:12])) + (", ..." if len(codes) > 12 else "")
    return f"one of {shown}"


def code_allowed(schema: DatasetSchema, column: str, values: pd.Series) -> pd.Series:
    """Per row: is the cell a code `checks.codes` allows (<NA> for an empty cell)."""
    codes = schema.checks.codes[column]
    empty = is_empty(values)
    if isinstance(codes, CodeRange):
        num = to_numbers(values)
        ok = (num == num.round()) & (num >= codes.min) & (num <= codes.max)
    else:
        ok = values.map(canonical).isin({canonical(c) for c in codes})
    return ok.astype("boolean").where(~empty, pd.NA)


# --------------------------------------------------------------------------------------------- images
def _syntax_problem(relative: str) -> str | None:
    if not relative:
        return "empty path"
    if "\x00" in relative:
        return "path contains a NUL byte"
    if relative.startswith(("/", "\\", "~")) or (len(relative) > 1 and relative[1] == ":"):  # C:/x.jpg
        return "absolute path (must be relative to the dataset folder, like images/photo-1.jpg)"
    if "\\" in relative:
        return "backslash in path (use '/' separators)"
    if ".." in relative.split("/"):
        return "path contains '..' (must stay inside the dataset folder)"
    return None


class _PathInspector:
    """Safety and existence of many image paths under one root with one lstat per file: folders are
    resolved once (all images share a few), files resolved only when they are symlinks."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.realpath(root)
        self._folders: dict[str, str] = {}

    def _inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def inspect(self, relative: str) -> tuple[str | None, bool]:
        """(why the path is unsafe or None, whether it is an existing regular file)."""
        why = _syntax_problem(relative)
        if why:
            return why, False
        folder, name = posixpath.split(relative)
        real_folder = self._folders.get(folder)
        if real_folder is None:
            real_folder = self._folders[folder] = os.path.realpath(os.path.join(self.root, folder))
        path = os.path.join(real_folder, name)
        if not self._inside(real_folder):
            return f"resolves outside the dataset folder (symlink to {path})", False
        try:
            st = os.lstat(path)
        except OSError:
            return None, False
        if stat.S_ISLNK(st.st_mode):
            real = os.path.realpath(path)
            if not self._inside(real):
                return f"resolves outside the dataset folder (symlink to {real})", False
            return None, os.path.isfile(real)
        return None, stat.S_ISREG(st.st_mode)


def image_path_problem(relative: str, root: Path) -> str | None:
    """Why `relative` is not a safe image path inside the dataset folder `root`, or None.

    Safe means: relative, '/'-separated, no '..' part, and still inside `root` after symlinks resolve.
    """
    return _PathInspector(root).inspect(relative)[0]


def decode_problem(path: Path) -> str | None:
    """Why the image at `path` does not decode, or None. Decodes the whole stream (truncation shows up)."""
    try:
        with Image.open(path) as im:
            # A reduced-scale JPEG decode still reads every byte of the entropy-coded data, at a
            # fraction of the cost for large photos.
            im.draft("RGB", (64, 64))
            im.load()
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return f"does not decode ({type(e).__name__}: {e})"
    return None


def decode_problems(paths: Iterable[Path], workers: int = 1) -> dict[Path, str | None]:
    """decode_problem for each distinct path, over `workers` forked processes (threads where fork is not
    available or the batch is small).

    A 64 px JPEG decodes in ~0.2 ms, most of it Python-level work under the GIL, so threads do not scale
    (0.8x with 2 threads, bench/validate.py); forked workers start in ~50 ms without re-importing anything
    and gave 1.7x with 2 on 4,000 images. Workers only open files with PIL and return strings.
    """
    unique = list(dict.fromkeys(paths))
    if workers <= 1 or len(unique) < 2:
        return {p: decode_problem(p) for p in unique}
    # Chunks keep the per-task overhead small next to a decode.
    size = max(1, min(256, len(unique) // (workers * 8)))
    chunks = [unique[i : i + size] for i in range(0, len(unique), size)]
    if len(unique) >= _FORK_MIN_IMAGES and "fork" in multiprocessing.get_all_start_methods():
        pool: Executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
    else:
        pool = ThreadPoolExecutor(max_workers=workers)
    with pool:
        verdicts = [v for part in pool.map(_decode_chunk, chunks) for v in part]
    return dict(zip(unique, verdicts, strict=True))


# Below this many images a fork costs more than it saves.
_FORK_MIN_IMAGES = 500


def _decode_chunk(paths: list[Path]) -> list[str | None]:
    return [decode_problem(p) for p in paths]


def check_images(images: pd.Series, root: Path, workers: int = 1, decode: bool = True) -> pd.DataFrame:
    """Per row: are all image paths safe, do the files exist, do they decode; plus the first issue.

    `images` holds the ';'-separated relative paths of each row; `root` is the dataset folder.
    """
    inspector = _PathInspector(root)
    n = len(images)
    # Plain lists while looping (setting items of a pandas BooleanArray one by one is ~50x slower).
    safe: list[bool | None] = [None] * n
    exist: list[bool | None] = [None] * n
    decodes: list[bool | None] = [None] * n
    issue = [""] * n
    row_files: list[list[str]] = [[] for _ in range(n)]
    for i, cell in enumerate(images.tolist()):
        paths = split_images(cell)
        if not paths:
            continue
        verdicts = [(p, *inspector.inspect(p)) for p in paths]
        bad = [(p, why) for p, why, _exists in verdicts if why]
        safe[i] = not bad
        if bad:
            issue[i] = f"{bad[0][0]}: {bad[0][1]}"
            continue
        missing = [p for p, _why, exists in verdicts if not exists]
        exist[i] = not missing
        if missing:
            issue[i] = f"{missing[0]}: file not found"
            continue
        row_files[i] = paths
    if decode:
        decoded = decode_problems(
            (Path(inspector.root, p) for paths in row_files for p in paths), workers
        )
        for i, paths in enumerate(row_files):
            if not paths:
                continue
            bad_files = [(p, decoded[Path(inspector.root, p)]) for p in paths if decoded[Path(inspector.root, p)]]
            decodes[i] = not bad_files
            if bad_files:
                issue[i] = f"{bad_files[0][0]}: {bad_files[0][1]}"
    out = pd.DataFrame(
        {col: pd.array(values, dtype="boolean")
         for col, values in ((PATHS_SAFE, safe), (IMAGES_EXIST, exist), (IMAGES_DECODE, decodes))},
        index=images.index,
    )
    out[IMAGE_ISSUE] = pd.Series(issue, index=images.index, dtype="str")
    return out


# ------------------------------------------------------------------------------------------- tabular
def tabular_problems(df: pd.DataFrame, schema: DatasetSchema) -> pd.DataFrame:
    """Per row and feature column, the reason a value is bad ("" when good): an empty required cell, text in
    a numerical column, a code `checks.codes` does not allow, a number outside `checks.bounds`.

    Missing columns are not reported here (see `missing_columns`)."""
    reasons = pd.DataFrame(index=df.index)
    required = set(schema.checks.required) | ({schema.id} if schema.id else set())
    for col in (c for c in schema.feature_columns if c in df.columns):
        raw = df[col]
        why = pd.Series("", index=df.index, dtype="str")
        empty = is_empty(raw)
        if col in required:
            why[empty] = "empty"
        if col in schema.columns.numerical:
            why[not_a_number(raw)] = "not a number"
            if col in schema.checks.bounds:
                low, high = schema.checks.bounds[col]
                num = to_numbers(raw)
                why[num.notna() & ((num < low) | (num > high))] = f"outside the plausible range {low:g}-{high:g}"
        if col in schema.checks.codes:
            bad = code_allowed(schema, col, raw) == False  # noqa: E712 -- <NA> (empty) is not bad here
            why[bad.fillna(False).astype(bool)] = f"not a valid code ({code_meaning(schema, col)})"
        if (why != "").any():
            reasons[col] = why
    return reasons


def missing_columns(df: pd.DataFrame, required: Iterable[str]) -> list[str]:
    return [c for c in required if c not in df.columns]


@dataclass(frozen=True)
class RowProblem:
    """One refused cell of a row to predict: the row (its index label), the column, the cell's value and why;
    for a photo, `file` is the image path the reason is about."""

    index: Any
    column: str
    value: Any
    reason: str
    file: str | None = None


def row_problems(df: pd.DataFrame, images_root: str | os.PathLike[str], schema: DatasetSchema,
                 workers: int = 1) -> list[RowProblem]:
    """Every per-row problem of `df` (rows to predict, with the required columns): the validation suite's
    per-row rules (required values, numbers, code sets, plausible amounts, safe existing decodable images),
    tabular columns first, then photos (the first bad file of a row)."""
    problems: list[RowProblem] = []
    reasons = tabular_problems(df, schema)
    for col in reasons.columns:
        for idx, why in reasons[col][reasons[col] != ""].items():
            value = df.at[idx, col]
            problems.append(RowProblem(idx, col, value.item() if hasattr(value, "item") else value, why))
    image_columns = [c for c in schema.columns.image if c in df.columns]
    if image_columns:
        img = check_images(image_cells(df, image_columns), Path(images_root), workers=workers)
        bad_img = ~img[list(IMAGE_CHECK_COLUMNS)].fillna(True).all(axis=1)
        for idx, text in img.loc[bad_img, IMAGE_ISSUE].items():
            path, _, why = text.partition(": ")
            col = next((c for c in image_columns if path in split_images(df.at[idx, c])), image_columns[0])
            problems.append(RowProblem(idx, col, df.at[idx, col], why, file=path))
    return problems


def check_prediction_rows(df: pd.DataFrame, images_root: str | os.PathLike[str], schema: DatasetSchema,
                          workers: int = 1, source: str | os.PathLike[str] | None = None) -> None:
    """Refuse rows a trained model cannot score: raise ValueError naming row, column or file, and the fix.
    `source`: the file the rows were read from; a row is then also named by its 1-based data line (after
    the header) and, where the rows have it, its id.

    `df` holds new rows without the label (a label column is ignored); `images_root` is the folder the image
    paths are relative to. The validation suite's per-row rules (required values, numbers, code sets,
    plausible amounts, safe existing decodable images), minus the dataset-level ones (uniqueness, class
    presence, a preset's tolerant row rules).
    """
    needed = [c for c in schema.required_features if c != schema.id]
    missing = missing_columns(df, needed)
    if missing:
        raise ValueError(
            f"{source if source is not None else 'prediction rows'}: lack required column(s) {missing}; add them (the model was trained on the columns "
            f"{needed}, image cells as ';'-separated relative paths)"
        )
    if df.empty:
        raise ValueError(f"{source}: a header and no rows: there is nothing to predict; pass a CSV with at least one "
                         "data line" if source is not None else "no rows to predict: pass a DataFrame with at least one row")
    position = {idx: i for i, idx in enumerate(df.index)} if source is not None else {}

    def row(idx: Any) -> str:
        if source is None:
            return f"row {idx!r}"
        key = f", {schema.id} {df.at[idx, schema.id]!r}" if schema.id and schema.id in df.columns else ""
        return f"{source} data line {position[idx] + 1} (index {idx!r}{key})"

    problems = [f"{row(p.index)}, file {p.file}: {p.reason}" if p.file is not None
                else f"{row(p.index)}, column '{p.column}': value {p.value!r} is {p.reason}"
                for p in row_problems(df, images_root, schema, workers)]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{len(problems)} problem(s) in the prediction rows (images relative to {images_root}):\n  {shown}{more}\n"
            "Fix: correct or drop these rows; codes and bounds follow the dataset's checks (model_config.json "
            "`dataset`), and every image must be a readable file inside the images folder."
        )

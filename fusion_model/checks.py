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
from pathlib import Path

import pandas as pd
from PIL import Image

from fusion_model.schema import (
    CATEGORICAL_COLUMNS,
    CODE_RANGES,
    FEATURE_COLUMNS,
    IMAGES,
    NUMERIC_BOUNDS,
    TEXT_COLUMNS,
    breeds,
    split_images,
    states,
)

# Derived per-row columns (the names the validation suite expects to be true).
PATHS_SAFE = "image_paths_safe"
IMAGES_EXIST = "images_exist"
IMAGES_DECODE = "images_decode"
IMAGE_ISSUE = "image_issue"  # the first bad file of the row and why ("" when none)
IMAGE_CHECK_COLUMNS: tuple[str, ...] = (PATHS_SAFE, IMAGES_EXIST, IMAGES_DECODE)
BREED_MATCHES_TYPE = "breed1_matches_type"

# Feature columns that must hold a value (text may be empty: real rows have empty names; Images may be
# empty: real rows without a photo, whose image input the model masks).
NON_NULL_FEATURES: tuple[str, ...] = tuple(c for c in FEATURE_COLUMNS if c not in (*TEXT_COLUMNS, IMAGES))


def allowed_codes(column: str) -> list[int]:
    """The valid integer codes of a categorical column (State: the 15 state ids of the code table)."""
    if column == "State":
        return sorted(states())
    r = CODE_RANGES[column]
    return list(range(r.low, r.high + 1))


def code_meaning(column: str) -> str:
    if column == "State":
        return "a Malaysian state id from state_labels.csv (41324-41415)"
    r = CODE_RANGES[column]
    return f"{r.low}-{r.high}: {r.meaning}"


def to_numbers(values: pd.Series) -> pd.Series:
    """Numbers as float64; empty cells and anything that is not a number become NaN (then fail not-null)."""
    if pd.api.types.is_bool_dtype(values):
        return pd.Series(float("nan"), index=values.index)
    return pd.to_numeric(values, errors="coerce").astype("float64")


def breed_matches_type(animal_type: pd.Series, breed1: pd.Series) -> pd.Series:
    """Per row: is Breed1 a breed of the row's Type (breed_labels.csv)? 0 (unknown) and 307 (mixed) fit
    both. <NA> where either code is missing or unknown (other checks report those)."""
    of_type = {b: t for b, (t, _name) in breeds().items()}
    breed_type = breed1.map(of_type)
    fits = (breed_type == animal_type) | breed1.isin([0, 307])
    known = animal_type.isin([1, 2]) & (breed1.isin([0]) | breed_type.notna())
    return fits.astype("boolean").where(known, pd.NA)


# --------------------------------------------------------------------------------------------- images
def _syntax_problem(relative: str) -> str | None:
    if not relative:
        return "empty path"
    if "\x00" in relative:
        return "path contains a NUL byte"
    if relative.startswith(("/", "\\", "~")) or (len(relative) > 1 and relative[1] == ":"):  # C:/x.jpg
        return "absolute path (must be relative to the dataset folder, like images/<PetID>-1.jpg)"
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
def tabular_problems(df: pd.DataFrame) -> pd.DataFrame:
    """Per row and feature column, the reason a value is bad ("" when good): nulls, codes, bounds.

    Missing columns are not reported here (see `missing_columns`).
    """
    reasons = pd.DataFrame(index=df.index)
    for col in (c for c in NON_NULL_FEATURES if c in df.columns):
        raw = df[col]
        why = pd.Series("", index=df.index, dtype="str")
        num = to_numbers(raw)  # every non-null feature is a code or an amount
        empty = raw.isna() | (raw.astype("str").str.strip() == "")
        why[empty] = "empty"
        why[num.isna() & ~empty] = "not a number"
        if col in CATEGORICAL_COLUMNS:
            bad = num.notna() & ~num.isin(allowed_codes(col))
            why[bad] = f"not a valid code ({code_meaning(col)})"
        else:
            low, high = NUMERIC_BOUNDS[col]
            bad = num.notna() & ((num < low) | (num > high))
            why[bad] = f"outside the plausible range {low:g}-{high:g}"
        reasons[col] = why
    return reasons


def missing_columns(df: pd.DataFrame, required: Iterable[str] = FEATURE_COLUMNS) -> list[str]:
    return [c for c in required if c not in df.columns]


def check_prediction_rows(df: pd.DataFrame, images_root: str | os.PathLike[str], workers: int = 1) -> None:
    """Refuse rows a trained model cannot score: raise ValueError naming row, column or file, and the fix.

    `df` holds new rows without the label (a label column is ignored); `images_root` is the folder the
    `Images` paths are relative to. The validation suite's per-row rules (required values, code sets,
    plausible amounts, safe existing decodable images), minus the dataset-level ones (uniqueness, class
    presence, the Breed/Type tolerance).
    """
    missing = missing_columns(df)
    if missing:
        raise ValueError(
            f"prediction rows lack required column(s) {missing}; add them (see fusion_model.schema."
            f"FEATURE_COLUMNS: the PetFinder columns, with Images as ';'-separated relative paths)"
        )
    if df.empty:
        raise ValueError("no rows to predict: pass a DataFrame with at least one row")
    problems: list[str] = []
    reasons = tabular_problems(df)
    for col in reasons.columns:
        for idx, why in reasons[col][reasons[col] != ""].items():
            value = df.at[idx, col]
            value = value.item() if hasattr(value, "item") else value  # numpy scalar -> plain repr
            problems.append(f"row {idx!r}, column '{col}': value {value!r} is {why}")
    img = check_images(df[IMAGES], Path(images_root), workers=workers)
    bad_img = ~img[list(IMAGE_CHECK_COLUMNS)].fillna(True).all(axis=1)
    for idx, text in img.loc[bad_img, IMAGE_ISSUE].items():
        problems.append(f"row {idx!r}, file {text}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"{len(problems)} problem(s) in the prediction rows (images relative to {images_root}):\n  {shown}{more}\n"
            "Fix: correct or drop these rows; codes follow fusion_model.schema.CODE_RANGES, numbers "
            "NUMERIC_BOUNDS, and every image must be a readable file inside the images folder."
        )

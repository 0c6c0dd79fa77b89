"""A `dataset.frequency` key's target encoding: the label's mean over the training rows sharing the row's value
(scikit-learn's TargetEncoder: shrunk towards the label's mean as far as the value's rows are few; one share
per class for classes), saved as a plain table, and the training rows' own values cross-fitted over five folds,
so that no row's encoding holds its own label. Crossed keys too: the key of most values with each code (a
rescuer's mean among its cats, among its vaccinated pets), as CatBoost's combinations of categorical features."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from fusion_model.dataset import canonical

TARGET_SUFFIX = " target"  # the numeric input(s) of a frequency key's label mean
UNSEEN = ""  # the table's entry for a value training never saw (and for an empty key): the label's mean
CROSS = " & "  # a crossed key's name: its columns, joined
JOINT = "\x1f"  # between a crossed key's values (a character no cell text holds)


def target_type(n_classes: int) -> str:
    """TargetEncoder's kind of label: a regression's value, a binary label's positive share, or a share per
    class (an ordinal label's too: the cumulative link reads each class)."""
    return "continuous" if n_classes < 2 else "binary" if n_classes == 2 else "multiclass"


def keyed_columns(frequency: list[str], codes: list[str], counts: dict[str, dict[str, int]], crosses: bool
                  ) -> dict[str, list[str]]:
    """Each table's name -> the columns whose values make its key: every frequency key alone; with `crosses`,
    the key of most distinct training values also with each code that is not a key."""
    tables = {key: [key] for key in frequency}
    if crosses and frequency:
        key = max(frequency, key=lambda c: len(counts.get(c, {})))
        tables.update({key + CROSS + code: [key, code] for code in codes if code not in frequency})
    return tables


def key_values(df: pd.DataFrame, columns: list[str]) -> pd.Series:
    """Each row's key of a table: the canonical text of its column(s), joined; "" (the label's mean) when the
    first, the frequency key, is empty or absent."""
    parts = [df[c].map(canonical) if c in df.columns else pd.Series("", index=df.index, dtype=object)
             for c in columns]
    key = parts[0]
    for part in parts[1:]:
        key = key.where(parts[0] == "", key + JOINT + part)
    return key


def fit_table(keys: pd.Series, labels: np.ndarray, kind: str) -> tuple[dict[str, list[float]], dict[Any, np.ndarray]]:
    """(value -> encoding, with UNSEEN; training row index -> its cross-fitted encoding)."""
    if not keys.index.is_unique:  # a row's own encoding is found by its index: a repeated one would take another's
        raise ValueError(f"the training rows' index repeats values ({keys.index[keys.index.duplicated()][:3].tolist()}"
                         "...); give them unique row ids (validate's row_id) or reset_index() before fitting")
    from sklearn.model_selection import KFold, StratifiedKFold
    from sklearn.preprocessing import TargetEncoder

    folds = (KFold if kind == "continuous" else StratifiedKFold)(5, shuffle=True, random_state=0)
    encoder = TargetEncoder(target_type=kind, cv=folds)
    own = encoder.fit_transform(keys.to_numpy(dtype=object)[:, None], labels)
    table = np.stack([np.asarray(e, dtype=float) for e in encoder.encodings_], axis=1)  # [values, outputs]
    out = {str(k): [float(v) for v in row] for k, row in zip(encoder.categories_[0], table, strict=True)}
    out[UNSEEN] = [float(v) for v in np.atleast_1d(encoder.target_mean_)]
    return out, dict(zip(keys.index, own.astype(float), strict=True))


def column_names(key: str, table: dict[str, list[float]]) -> list[str]:
    width = len(table[UNSEEN])
    return [key + TARGET_SUFFIX + (f" {k}" if width > 1 else "") for k in range(width)]


def encode(keys: pd.Series, table: dict[str, list[float]], own: dict[Any, np.ndarray] | None = None) -> np.ndarray:
    """[rows, outputs]: each key's table entry (an empty key: the label's mean, as for an unseen value), or
    with `own` (the training rows', by the frame's index: validate's row ids), a row's own cross-fitted
    encoding where it is one of them."""
    unseen = table[UNSEEN]
    values = np.array([table.get(k, unseen) if k else unseen for k in keys], dtype=float).reshape(len(keys), -1)
    if own:
        for i, (row, key) in enumerate(zip(keys.index, keys, strict=True)):
            if key and row in own:
                values[i] = own[row]
    return values

"""The text's hashed n-grams: the cached per-word path gives exactly the buckets, counts, order and idf of
the definition (`ngrams` hashed gram by gram), so models fitted before it read text as they were trained."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from fusion_model.preprocess import Preprocessor
from fusion_model.text_grams import GramMemo, _hash, fit_text_tables, gram_order, hashed_grams, ngrams

TEXTS = ["", "  ", "a", "Über café naïve 123 x-y", "the the the", "a b a b a b c",
         "Friendly puppy, loves kids! Vaccinated & dewormed; 3 months old. Call 012-345 6789.",
         "Runs small: order a size up. Runs small, runs SMALL.", "x" * 40]


@pytest.mark.parametrize(("n", "chars", "buckets"), [(3, 4, 262144), (1, 0, 1000), (2, 3, 97), (3, 0, 5)])
def test_hashed_grams_are_the_definitions_buckets_in_order(n: int, chars: int, buckets: int) -> None:
    for text in TEXTS:
        blocks = hashed_grams(text, n, chars, buckets)
        grams = ngrams(text, n, chars)
        assert [h for block in blocks for h in block] == [_hash(g, buckets) for g in grams]
        assert len(blocks) == n + 1
        orders = [k for k, block in enumerate(blocks, start=1) for _ in block]
        assert orders == [gram_order(g, n) for g in grams]


def _reference_tables(texts: list[str], n: int, chars: int, buckets: int, min_df: int) -> dict[str, np.ndarray]:
    df_count = np.zeros(buckets, dtype=np.int64)
    order = np.full(buckets, n + 2, dtype=np.int64)
    for text in texts:
        seen: dict[int, int] = {}
        for g in ngrams(text, n, chars):
            h = _hash(g, buckets)
            seen[h] = min(seen.get(h, n + 2), gram_order(g, n))
        for h, k in seen.items():
            df_count[h] += 1
            order[h] = min(order[h], k)
    kept = np.flatnonzero(df_count >= min_df)
    kept = kept[kept > 0]
    rows = np.zeros(buckets, dtype=np.int64)
    rows[kept] = np.arange(1, len(kept) + 1)
    idf = np.log((1 + len(texts)) / (1 + df_count[kept])) + 1
    return {"rows": rows, "idf": np.concatenate([[0.0], idf]).astype(np.float32),
            "order": np.concatenate([[0], order[kept]]).astype(np.int64)}


@pytest.mark.parametrize(("n", "chars", "buckets", "max_features"), [(3, 4, 4096, 2048), (2, 3, 31, 7)])
def test_preprocessor_text_tables_and_rows_equal_the_definition(n: int, chars: int, buckets: int,
                                                                max_features: int) -> None:
    texts = TEXTS * 3 + [f"{t} extra {i}" for i, t in enumerate(TEXTS)]
    df = pd.DataFrame({"Description": texts})
    def preprocessor() -> Preprocessor:
        pre = Preprocessor.__new__(Preprocessor)
        pre.text_columns, pre.text_buckets, pre.text_ngrams = ["Description"], buckets, n
        pre.text_chars, pre.text_max_features = chars, max_features
        return pre

    pre = preprocessor()
    tables = fit_text_tables(pre._joined(df), pre._grams(), n, chars, buckets, max_features, 2)
    expected = _reference_tables(texts, n, chars, buckets, 2)
    for key in expected:
        np.testing.assert_array_equal(tables[key], expected[key], err_msg=key)
    ids, counts = pre.text(df)  # the rows the fit hashed, remembered
    fresh = preprocessor().text(df)  # hashed here
    assert torch.equal(ids, fresh[0]) and torch.equal(counts, fresh[1])
    assert "_gram_memo" not in pickle.loads(pickle.dumps(pre)).__dict__  # another process hashes its own
    for i, text in enumerate(texts):
        row = list(Counter(_hash(g, buckets) for g in ngrams(text, n, chars)).items())[:max_features]
        got = [(int(h), float(c)) for h, c in zip(ids[i].tolist(), counts[i].tolist(), strict=True) if h]
        assert got == [(h, float(c)) for h, c in row]
    assert ids.dtype == torch.int64 and counts.dtype == torch.float32


def test_the_memo_of_grams_is_emptied_when_full() -> None:
    memo = GramMemo(limit=10)
    six = (np.arange(6), np.ones(6, dtype=np.float32))
    memo.remember("a", six)
    memo.remember("b", (np.arange(4), np.ones(4, dtype=np.float32)))
    assert set(memo) == {"a", "b"} and memo.grams == 10
    memo.remember("c", six)  # over the limit: emptied first
    assert set(memo) == {"c"} and memo.grams == 6

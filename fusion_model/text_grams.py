"""The text's hashed n-grams: the joined text columns lower-cased, cut into word 1..n-grams and (with
`chars`) each word's character grams, each hashed into a bucket with crc32 (stable everywhere, no vocabulary
to download). `ngrams` is the definition; `hashed_grams` gives its buckets, cutting and hashing each distinct
word once."""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

_TOKEN = re.compile(r"[a-z0-9]+")
CHAR_MARK = "\x01"  # before a character gram: a word gram holds only [a-z0-9 ]


def _hash(gram: str, buckets: int) -> int:
    return 1 + zlib.crc32(gram.encode()) % (buckets - 1)


def ngrams(text: str, n: int, chars: int = 0) -> list[str]:
    """Word 1..n-grams of `text` (lower-cased `[a-z0-9]+` words), in order of appearance; then, with
    `chars`, the 1..chars-character grams of each word padded with a space (scikit-learn's `char_wb`),
    marked so that they never hash as a word does: they catch a word's spelling variants and stems, which
    lifted a linear model of real reviews (BENCHMARKS.md)."""
    words = _TOKEN.findall(text.lower())
    grams = list(words)
    for k in range(2, n + 1):
        grams += [" ".join(words[i : i + k]) for i in range(len(words) - k + 1)]
    for word in words if chars else ():
        padded = f" {word} "
        grams += [CHAR_MARK + padded[i : i + k] for k in range(1, chars + 1) for i in range(len(padded) - k + 1)]
    return grams


@lru_cache(maxsize=1 << 18)
def _word_ids(word: str, buckets: int, chars: int) -> tuple[int, tuple[int, ...]]:
    """A word's unigram bucket and its character grams' buckets, in `ngrams` order: words repeat across
    rows, so each is cut and hashed once (the grams of a few thousand rows otherwise take seconds)."""
    padded = f" {word} "
    return _hash(word, buckets), tuple(_hash(CHAR_MARK + padded[i : i + k], buckets)
                                       for k in range(1, chars + 1) for i in range(len(padded) - k + 1))


def hashed_grams(text: str, n: int, chars: int, buckets: int) -> list[list[int]]:
    """The buckets of `ngrams(text, n, chars)`, in the same order, as blocks: word 1-grams, ..., word
    n-grams, then the character grams (block k holds the grams of `gram_order` k + 1)."""
    words = _TOKEN.findall(text.lower())
    cached = [_word_ids(w, buckets, chars) for w in words]
    blocks = [[u for u, _ in cached]]
    for k in range(2, n + 1):
        blocks.append([_hash(" ".join(words[i : i + k]), buckets) for i in range(len(words) - k + 1)])
    char_ids: list[int] = []
    for _, grams in cached if chars else ():
        char_ids.extend(grams)
    blocks.append(char_ids)
    return blocks


def gram_order(gram: str, words: int) -> int:
    """A gram's block in the text weighting: its word count, or `words + 1` for a character gram."""
    return words + 1 if gram.startswith(CHAR_MARK) else gram.count(" ") + 1


def gram_counts(blocks: list[list[int]], max_features: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's distinct buckets of `hashed_grams` blocks in order of first appearance, block by block, and how
    often each occurs: the first `max_features` of them."""
    counts: Counter[int] = Counter()
    for block in blocks:
        counts.update(block)
    kept = list(counts.items())[:max_features]
    return np.array([k for k, _ in kept], dtype=np.int64), np.array([c for _, c in kept], dtype=np.float32)


class GramMemo(dict[str, tuple[np.ndarray, np.ndarray]]):
    """A text -> its `gram_counts`, for texts seen again: the training rows feed the preprocessor's fit, the
    linear member and the data loader, and hashing a few thousand rows' grams takes seconds. Emptied when it
    holds `limit` grams (a long-lived scoring process sees texts without end)."""

    def __init__(self, limit: int = 1 << 23) -> None:
        super().__init__()
        self.limit, self.grams = limit, 0

    def remember(self, text: str, value: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if self.grams + len(value[0]) > self.limit:
            self.clear()
            self.grams = 0
        self[text] = value
        self.grams += len(value[0])
        return value


def fit_text_tables(texts: Iterable[str], memo: GramMemo, n: int, chars: int, buckets: int, max_features: int,
                    min_df: int) -> dict[str, np.ndarray]:
    """The training texts' tables: which buckets the model keeps (seen in >= min_df texts), remapped to rows
    1..V of its table; their idf (smoothed, as scikit-learn's) and n-gram order (the lowest, on a hash
    collision). Each text's `gram_counts` are remembered in `memo` on the way."""
    df_count = np.zeros(buckets, dtype=np.int64)
    order = np.full(buckets, n + 2, dtype=np.int64)
    pending_ids: list[int] = []  # texts' distinct buckets and orders, counted in chunks (numpy, not per text)
    pending_orders: list[int] = []

    def count() -> None:
        ids = np.asarray(pending_ids, dtype=np.int64)
        df_count[:] += np.bincount(ids, minlength=buckets)
        np.minimum.at(order, ids, np.asarray(pending_orders, dtype=np.int64))
        pending_ids.clear()
        pending_orders.clear()

    rows_seen = 0
    for text in texts:
        rows_seen += 1
        blocks = hashed_grams(text, n, chars, buckets)
        memo.remember(text, gram_counts(blocks, max_features))  # what `text` gives the row
        seen: dict[int, int] = {}  # bucket -> its lowest order in the text: the lowest block written last
        for k in range(len(blocks), 0, -1):
            seen.update(dict.fromkeys(blocks[k - 1], k))
        pending_ids.extend(seen)
        pending_orders.extend(seen.values())
        if len(pending_ids) > 1 << 20:
            count()
    count()
    kept = np.flatnonzero(df_count >= min_df)
    kept = kept[kept > 0]
    rows = np.zeros(buckets, dtype=np.int64)
    rows[kept] = np.arange(1, len(kept) + 1)
    idf = np.log((1 + rows_seen) / (1 + df_count[kept])) + 1
    return {"rows": rows, "idf": np.concatenate([[0.0], idf]).astype(np.float32),
            "order": np.concatenate([[0], order[kept]]).astype(np.int64)}

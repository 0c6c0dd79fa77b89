"""Names and descriptions for the embedded dataset.

A description mixes filler words with signal words; the share of "adoptable" versus "hard to place" signal
words follows the row's hidden text score, so token counts carry the text signal, partly (short texts and
filler keep it noisy). Some words echo the row's tabular codes (kitten/puppy, coat colour), as real
descriptions do.
"""

from __future__ import annotations

import numpy as np

NAMES = (
    "Milo", "Luna", "Coco", "Max", "Bella", "Oreo", "Tiger", "Lucky", "Snowy", "Kiki", "Brownie", "Mimi",
    "Simba", "Lily", "Charlie", "Ginger", "Teddy", "Bobby", "Putih", "Comot", "Manja", "Oyen", "Tompok",
    "Chomel", "Boboy", "Belang", "Shadow", "Rocky", "Daisy", "Nala", "Leo", "Mochi", "Pepper", "Cookie",
    "Bubu", "Sugar", "Honey", "Angel", "Blackie", "Goldie",
)
# Real exports hold placeholder names as well as empty cells.
PLACEHOLDER_NAMES = ("No Name", "No Name Yet", "Unnamed", "Baby", "Boy", "Girl")

POSITIVE = (
    "playful", "friendly", "affectionate", "healthy", "cheerful", "gentle", "adorable", "cute", "loving",
    "active", "smart", "cuddly", "sweet", "vaccinated", "dewormed", "litter-trained", "toilet-trained",
    "obedient", "lovely", "energetic", "charming", "fluffy", "tame", "calm",
)
NEGATIVE = (
    "shy", "timid", "scared", "injured", "sick", "aggressive", "nervous", "skinny", "blind", "limping",
    "wound", "fever", "abandoned", "traumatised", "fierce", "weak", "skin-problem", "hissing", "lame",
    "ticks", "fleas", "urgent", "neglected", "disabled",
)
FILLER = (
    "the", "a", "is", "was", "and", "to", "for", "he", "she", "very", "found", "near", "home", "looking",
    "new", "owner", "please", "call", "me", "rescued", "from", "street", "market", "drain", "our", "house",
    "adopt", "interested", "whatsapp", "months", "old", "with", "his", "her", "siblings", "mother", "food",
    "eats", "dry", "wet", "likes", "play", "people", "other", "pets", "taman", "area", "kindly", "only",
    "serious", "adopters", "thanks",
)
# Words that echo tabular codes: young animals, and coat colour by Color1 id (1-7).
YOUNG = {1: "puppy", 2: "kitten"}
ADULT = {1: "dog", 2: "cat"}
COLOUR_WORDS = ("", "black", "brown", "golden", "yellow", "cream", "grey", "white")

SIGNAL_SHARE = 0.35  # fraction of words that are signal words
SIGNAL_SHARPNESS = 1.6  # how strongly the text score tilts signal words positive


def draw_names(rng: np.random.Generator, n: int, empty_share: float) -> list[str]:
    u = rng.random(n)
    real = rng.integers(0, len(NAMES), n)
    placeholder = rng.integers(0, len(PLACEHOLDER_NAMES), n)
    return [
        "" if u[i] < empty_share
        else PLACEHOLDER_NAMES[placeholder[i]] if u[i] < empty_share + 0.04
        else NAMES[real[i]]
        for i in range(n)
    ]


def draw_descriptions(
    rng: np.random.Generator,
    score: np.ndarray,
    pet_type: np.ndarray,
    age_months: np.ndarray,
    color1: np.ndarray,
    empty: np.ndarray,
) -> list[str]:
    """One description per row; rows where `empty` is True get "" (their text score carries nothing)."""
    n = len(score)
    max_words = 48
    length = np.clip(8 + rng.poisson(18, n), 8, max_words)
    kind = rng.random((n, max_words))  # < SIGNAL_SHARE: signal word, else filler
    p_positive = 1.0 / (1.0 + np.exp(-SIGNAL_SHARPNESS * score))
    positive = rng.random((n, max_words)) < p_positive[:, None]
    pos_idx = rng.integers(0, len(POSITIVE), (n, max_words))
    neg_idx = rng.integers(0, len(NEGATIVE), (n, max_words))
    fill_idx = rng.integers(0, len(FILLER), (n, max_words))
    mention_colour = rng.random(n) < 0.5

    texts: list[str] = []
    for i in range(n):
        if empty[i]:
            texts.append("")
            continue
        animal = YOUNG[int(pet_type[i])] if age_months[i] < 12 else ADULT[int(pet_type[i])]
        words = [COLOUR_WORDS[int(color1[i])], animal] if mention_colour[i] else [animal]
        for j in range(int(length[i])):
            if kind[i, j] < SIGNAL_SHARE:
                words.append(POSITIVE[pos_idx[i, j]] if positive[i, j] else NEGATIVE[neg_idx[i, j]])
            else:
                words.append(FILLER[fill_idx[i, j]])
        text = " ".join(words)
        texts.append(text[0].upper() + text[1:] + ".")
    return texts

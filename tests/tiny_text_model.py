"""A tiny BERT-style text model folder built offline: a WordPiece vocabulary trained with `tokenizers` on
the test's own text, a small config saved with `save_pretrained`, random weights (no hub download)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch


def make_text_model(folder: Path, texts: Iterable[str], hidden: int = 32, layers: int = 2, seed: int = 0,
                    heads: int = 2, intermediate: int | None = None, vocab_size: int | None = None,
                    max_positions: int = 64) -> Path:
    """`vocab_size`: the embedding's rows (default: the trained vocabulary's size; larger leaves rows unused,
    as a real model's vocabulary exceeds one table's words)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(list(texts), trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=max(vocab_size or 0, tokenizer.get_vocab_size()), hidden_size=hidden,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate or 2 * hidden, max_position_embeddings=max_positions)
    BertModel(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder

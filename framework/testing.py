"""A tiny random BERT for tests and benchmarks: trains in milliseconds, needs no download."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_tiny_bert(folder: Path, words: Sequence[str], num_labels: int = 2, head: bool = True) -> Path:
    """Save a 2-layer BERT classifier (hidden 32, random init from seed 0, no dropout) and a WordPiece
    tokenizer over ``words`` into ``folder``, loadable with ``from_pretrained``. No dropout, so runs with
    different process counts or loops can be compared exactly. ``head=False``: the encoder alone, as a pretrained
    checkpoint is, so a classifier loaded from it draws a new head (the run's seed)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = SPECIAL_TOKENS + [w for w in dict.fromkeys(words) if w not in SPECIAL_TOKENS]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)}, do_lower_case=True)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=num_labels,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    (model if head else model.bert).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_word_tokenizer(folder: Path, words: Sequence[str]) -> Path:
    """A word-level tokenizer over ``words`` (lower-cased, split on whitespace and punctuation) with
    ``<eos>``, ``<pad>``, ``<unk>`` and ``<mask>``: small vocabularies keep language-model tests fast."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<eos>", "<pad>", "<unk>", "<mask>"]
    vocab = {w: i for i, w in enumerate(special + [w for w in dict.fromkeys(words) if w not in special])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>",
                                        unk_token="<unk>", mask_token="<mask>", model_max_length=512)
    tokenizer.save_pretrained(folder)
    return folder

"""The tiny world's tokenizer: one token per word of its vocabulary (no download, no training).

Word-level, split on whitespace: every word of a prompt or an answer is one token, so a task's table is a
table of tokens and decoding is exact (tokens joined by single spaces). Every encoded text starts with BOS,
the same whether transformers or vLLM does the encoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"


def write_tokenizer(words: Sequence[str], out_dir: Path):
    """Save a word-level Hugging Face fast tokenizer over `words` (ids: PAD 0, BOS 1, EOS 2, UNK 3,
    then the words in order) in `out_dir` and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.save_pretrained(out_dir)
    return fast

"""A tiny tokenizer that can spell JSON, regexes' words and choices, for structured-output tests.

`tests.tiny_models.tiny_tokenizer` is word-level (`w4`, `w5`, ...): no grammar over characters
could use it. This one is a real BPE over single characters plus merged pieces (`{"`, `": `,
`", "`, `true`, ...), as large as the tiny models' vocabulary (96), so a grammar has both
one-character and multi-character ways to spell the same text, as with a real tokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import TINY_VOCAB

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list('{}[]:," ') + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz") + list("-._")
# Merges, in rank order: each joins two pieces already in the vocabulary.
MERGES = [("{", '"'), ('"', ":"), ('":', " "), (",", " "), ('"', ", "), ('", ', '"'), ('"', "}"),
          ("[", '"'), ('"', "]"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("f", "a"), ("fa", "l"),
          ("fal", "s"), ("fals", "e"), ("n", "u"), ("nu", "l"), ("nul", "l"), ("c", "a"), ("ca", "t"),
          ("d", "o"), ("do", "g"), ("r", "e"), ("re", "d"), ("b", "l"), ("bl", "u"), ("blu", "e"),
          ("y", "e"), ("ye", "s"), ("n", "o"), ("a", "g"), ("ag", "e"), ("na", "m"), ("n", "a"),
          ("nam", "e"), ("i", "d"), ("1", "0"), ("0", "0"), ("e", "r"), ("o", "n")]


def json_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """<pad>=0 <bos>=1 <eos>=2 <unk>=3, the characters of CHARS, then the merged pieces, in that order."""
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) > vocab_size:
        raise ValueError(f"the JSON tokenizer needs {len(vocab)} ids, the model has {vocab_size}")
    # Fill the rest of the model's vocabulary with unused pieces (the grammar sees every id).
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    backend = Tokenizer(models.BPE(vocab, MERGES, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")

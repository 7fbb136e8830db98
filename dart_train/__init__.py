"""Building artifacts from corpora: the N-gram trie and the DART draft head.

Not part of the decoding runtime: workers never import this package. Its users are the
entry points in jobs/ (build_ngram, train_draft, distill_data, the benchmarks) and, for the
embedded default trie only, the pipeline driver (`ngram_build.default_trie_path`).

- `corpus`: conversations and texts from any fsspec URL or the packaged ShareGPT dump, with
  the fixed train/dev split, tokenized into one document per conversation;
- `ngram_build`: a corpus counted into an N-gram trie file plus its sidecar; the default trie;
- `draft_training`: the teacher pass, MASK-block layout and loss of draft-head training.

May import ngram_native and dart_worker (never pipeline or jobs).
"""

"""Building artifacts from corpora: the N-gram trie and the DART draft head.

Not part of the decoding runtime: workers never import this package. Its users are the
entry points in jobs/ (build_ngram, train_draft, distill_data, the benchmarks) and, for the
embedded default trie only, the pipeline driver (`ngram_build.default_trie_path`).

- `corpus`: conversations and texts from any fsspec URL or the packaged ShareGPT dump, with
  the fixed train/dev split, tokenized into one document per conversation;
- `ngram_build`: a corpus counted into an N-gram trie file plus its sidecar; the default trie;
- `draft_training`: the teacher pass, MASK-block layout and loss of draft-head training;
- `trainer`: the training config, data stream, loop (local or Ray Train), checkpoints and evaluation;
- `teacher_cache`, `teacher_cache_build`: the teacher cache's format, and building one;
- `replay`: tau of a drafter on the target's replies without verification forwards.

May import ngram_native and dart_worker (never pipeline, dart_bench or jobs).
"""

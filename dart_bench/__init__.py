"""The benchmarks: measuring code behind `python -m jobs.bench KIND [args ...]` (jobs/bench.py).

- `common`: what every benchmark shares (the target-and-prompts config, loading, prompts,
  transformers' baselines, run records and their summary against `ar`, machine conditions);
- `modes`, `matrix`, `report`: the mode x temperature x budget report (`report`) and its plots;
- `engine`, `templated`, `verify_shapes`: the engine alone (modes, batch sweeps, shared-prefill
  samples; the lookup job cache on templated rows; the verify forward by shape);
- `pipeline_job`, `load`: the whole Ray Data job, and its own machinery at scale;
- `ngram`: the N-gram trie's queries, tree builders and memory on the real corpus;
- `replay`, `tune_tree`, `job_ngram`, `context_bound`: tau by replay, without verify forwards;
- `compare_heads`, `teacher_cache`: draft heads side by side; training from the teacher cache.
- `equivalence`: the engine's before/after equality check (`python -m dart_bench.equivalence`): every
  mode, fixed and auto sizing under a synthetic clock, on tiny models; for refactors, not speed.

May import ngram_native, dart_worker, dart_train and pipeline (never jobs).
"""

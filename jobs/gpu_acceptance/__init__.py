"""The GPU acceptance run: `python -m jobs.gpu_acceptance [device=cuda] [output_dir=...] [key=value ...]`.

One command that proves the engine on a machine with a GPU (correctness against transformers'
`generate`, speed of real shapes with random weights; no model weights). What it runs and why:
dart_bench/gpu_acceptance/; on a bare GPU machine: docs/gpu.md (`python -m jobs.gpu_acceptance.bundle`).
"""

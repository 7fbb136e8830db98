"""The GPU acceptance run: `python -m jobs.gpu_acceptance [device=cuda] [output_dir=...] [key=value ...]`.

One command that proves the engine on a machine with a GPU, within what such a machine is lent
for: a bare Python with torch and transformers, no model weights, minutes. It checks correctness
on the device (`correctness`: every drafter against transformers' `generate` on tiny random-weight
models, seeded sampling against `ar`, a chi-square test) and times real shapes with random weights
(`speed`: a Gemma-3-270M and a Llama-3-8B shape on CUDA), then writes `acceptance.json` and
`acceptance.md` under `output_dir` and exits 1 if any correctness check failed. The same command
runs on a CPU (`device=cpu`, small shapes) in the test suite, so it cannot rot between GPU runs.
How to run it on a bare GPU machine: docs/gpu.md. The command's entry point is
jobs/gpu_acceptance/__main__.py; everything it runs is here (`run`: the config, the sections, the report files).
"""

"""The GPU acceptance run: `python -m jobs.gpu_acceptance [device=cuda] [output_dir=...] [key=value ...]`.

One command that proves the engine on a machine with a GPU, within what such a machine is lent
for: a bare Python with torch and transformers, no model weights, minutes. It checks correctness
on the device (`correctness`: every drafter against transformers' `generate` on tiny random-weight
models, seeded sampling against `ar`, a chi-square test) and times real shapes with random weights
(`speed`: a Llama-3-8B and a Gemma-3-270M shape on CUDA). A lent GPU window is short and rare, so
the run (`runner`) writes `acceptance.json` and `acceptance.md` under `output_dir` as it goes,
records a section that raises and goes on, has one deadline from process start (a watchdog ends a
section that overruns it) and runs the most valuable sections first (`plan`). It exits 1 if a
correctness section failed or raised. The same command runs on a CPU (`device=cpu`, small
shapes, the GPU's kernel plan forced) in the test suite, so it cannot rot between GPU runs.
How to run it on a bare GPU machine and read its report: docs/gpu.md. The command's entry point is
jobs/gpu_acceptance/__main__.py; everything it runs is here (`run`: the config and `main`).
"""

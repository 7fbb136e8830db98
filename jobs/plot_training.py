"""Plot draft-head training curves from the `metrics.jsonl` files that `jobs.train_draft` appends:
`python -m jobs.plot_training <metrics.jsonl> [...] --out docs/training/curves.png [--labels a b]`.

    python -m jobs.plot_training runs/head/metrics.jsonl --out docs/training/curves.png

What it does and how: dart_train/training_plots.py.
"""

from __future__ import annotations

from dart_train.training_plots import main

if __name__ == "__main__":
    raise SystemExit(main())

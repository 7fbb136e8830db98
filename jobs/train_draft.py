"""Train a DART draft head: `python -m jobs.train_draft config.yaml [key=value ...]`.

    python -m jobs.train_draft configs/train_default_head.yaml                   # this CPU, in-process
    python -m jobs.train_draft configs/train_default_head.yaml trainer.max_steps=20 output_dir=/tmp/t
    python -m jobs.train_draft my.yaml trainer.backend=ray trainer.num_workers=4 trainer.use_gpu=true

The config schema, the loop and both backends: dart_train/trainer.py; the objective and the
choices: docs/training.md.
"""

from __future__ import annotations

from dart_train.trainer import parse_config, train


def main(argv: list[str] | None = None) -> dict:
    return train(parse_config(argv))


if __name__ == "__main__":
    main()

"""Build a teacher cache: `python -m jobs.build_teacher_cache config.yaml data.teacher_cache=<url> [key=value ...]`.

    python -m jobs.build_teacher_cache configs/train_default_head.yaml data.teacher_cache=/data/tc \
        cache.max_examples=4000
    python -m jobs.build_teacher_cache my.yaml data.teacher_cache=s3://bucket/tc/llama-8b cache.top_k=128

The config is the training config (the same file `python -m jobs.train_draft` runs with); what the
cache holds and how a killed build resumes: dart_train/teacher_cache_build.py.
"""

from __future__ import annotations

from dart_train.teacher_cache_build import build_teacher_cache
from dart_train.trainer import parse_config
from dart_worker.hardware.device import configure_cpu_threads


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    configure_cpu_threads(cfg.trainer.threads)
    return build_teacher_cache(cfg)


if __name__ == "__main__":
    main()

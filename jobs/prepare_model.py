"""From "my model" to a tuned job config: `python -m jobs.prepare_model TARGET [key=value ...]`.

    python -m jobs.prepare_model default                                  # the embedded Gemma-3-270M
    python -m jobs.prepare_model s3://bucket/models/qwen3-8b corpus='s3://bucket/chats/*.jsonl'
    python -m jobs.prepare_model /models/qwen3-8b head.source=/models/qwen8b-dart   # an upstream DART head
    python -m jobs.prepare_model default skip=[head] redo=[bench]

What it does and how: pipeline/prepare_model.py.
"""

from __future__ import annotations

from pipeline.prepare_model import main

if __name__ == "__main__":
    raise SystemExit(main())

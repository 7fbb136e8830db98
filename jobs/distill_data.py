"""Self-distillation data for draft-head training: `python -m jobs.distill_data [key=value ...]`.

What it does and how: pipeline/distill.py.
"""

from __future__ import annotations

from pipeline.distill import main

if __name__ == "__main__":
    raise SystemExit(main())

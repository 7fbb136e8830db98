"""`python -m jobs.gpu_acceptance [config.yaml] [key=value ...]`: see the package docstring."""

from __future__ import annotations

import sys

from dart_bench.gpu_acceptance.run import main
from dart_bench.gpu_acceptance.runner import process_started

if __name__ == "__main__":
    sys.exit(main(started=process_started()))  # the deadline counts the interpreter's and torch's start-up

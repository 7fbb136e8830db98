"""Example counts for property tests, scaled by the hypothesis profile in use.

A test's explicit `@settings(max_examples=N)` wins over any profile, so a profile alone cannot
make the quick loop smaller; `examples(N)` is N under every profile but `quick`, where it is a
tenth of N (at least 5). CI and the README's command run the full counts.
"""

from __future__ import annotations

import os

PROFILE_ENV = "HYPOTHESIS_PROFILE"
QUICK = "quick"


def examples(full: int) -> int:
    """`full` examples, or a tenth of them (at least 5, at most `full`) under the quick profile."""
    if os.environ.get(PROFILE_ENV) == QUICK:
        return min(full, max(5, full // 10))
    return full

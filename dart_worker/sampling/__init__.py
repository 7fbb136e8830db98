"""Token distributions and their checks: sampling parameters, logits processors, grammars, verification."""

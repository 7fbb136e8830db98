"""Per-request decoding statistics: acceptance (tau), tree sizes and stage timings.

tau is the mean number of tokens committed per verification round: accepted draft tokens
plus the one token the target always contributes (the bonus). Autoregressive decoding has
tau = 1 by construction; the token sampled at prefill is not part of any round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("prefill", "draft", "tree", "verify", "commit")


@dataclass
class RequestStats:
    """Everything measured for one request; cheap to update once per round."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per round
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round
    tree_depths: list[int] = field(default_factory=list)  # deepest draft node per round
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    wall_seconds: float = 0.0

    def record_round(self, accepted: int, tree_size: int, tree_depth: int) -> None:
        self.accept_lengths.append(accepted)
        self.tree_sizes.append(tree_size)
        self.tree_depths.append(tree_depth)

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (accepted + bonus); 0 when no round ran."""
        return (sum(self.accept_lengths) / self.rounds + 1.0) if self.rounds else 0.0

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / self.rounds if self.rounds else 0.0

    def acceptance_histogram(self, max_len: int | None = None) -> list[int]:
        """Counts of rounds by accepted length 0..max_len."""
        top = max(self.accept_lengths, default=0) if max_len is None else max_len
        hist = [0] * (top + 1)
        for a in self.accept_lengths:
            hist[min(a, top)] += 1
        return hist

    def per_position_acceptance(self, max_depth: int | None = None) -> list[float]:
        """For depth d = 1..: P(accepted length >= d | the tree reached depth d)."""
        top = max(self.tree_depths, default=0) if max_depth is None else max_depth
        rates = []
        for d in range(1, top + 1):
            offered = [a for a, depth in zip(self.accept_lengths, self.tree_depths) if depth >= d]
            rates.append(sum(a >= d for a in offered) / len(offered) if offered else 0.0)
        return rates

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_histogram": self.acceptance_histogram(),
            "per_position_acceptance": self.per_position_acceptance(),
            "mean_tree_size": self.mean_tree_size,
            "stage_seconds": dict(self.stage_seconds),
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }

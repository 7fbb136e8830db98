"""Per-request decoding statistics: acceptance (tau), tree sizes and stage timings.

tau is the mean number of tokens committed per verification round: accepted draft tokens
plus the one token the target always contributes (the bonus). Autoregressive decoding has
tau = 1 by construction; the token sampled at prefill is not part of any round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# "grammar": a structured-output request's grammar work of a round (cutting its tree, drafting its
# forced text, its masks over the tree); 0 for free text.
STAGES = ("prefill", "draft", "tree", "grammar", "verify", "commit")

# The one serialisation of a request's statistics: column name -> value type ("int", "float",
# "list[int]", "list[float]"), in output order. `RequestStats.to_row` fills exactly these; the
# pipeline's Parquet schema derives its statistics columns from this table, and the benchmarks
# record the same dict, so a new statistic is added here and in `to_row`, nowhere else.
STAT_COLUMNS: dict[str, str] = {
    "num_prompt_tokens": "int",
    "num_generated_tokens": "int",
    "rounds": "int",
    "tau": "float",
    "acceptance_histogram": "list[int]",
    "per_position_acceptance": "list[float]",
    "mean_tree_size": "float",
    "mean_batch_live": "float",  # sequences in the verify forward, mean over this request's rounds
    "model_rounds": "int",  # rounds in which the drafter's model (the draft head) ran
    "accepted_head": "int",  # accepted draft tokens the draft head proposed
    "accepted_context": "int",  # ... that context lookup proposed (a token both proposed counts for both)
    "accepted_job_cache": "int",  # ... that the job cache (earlier rows' outputs) proposed
    "accepted_grammar": "int",  # ... that the request's structured-output grammar forced
    **{f"{stage}_s": "float" for stage in STAGES},
    "wall_s": "float",
    "tokens_per_s": "float",
}


@dataclass
class RequestStats:
    """Everything measured for one request; cheap to update once per round."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per round
    accepted_tokens: int = 0  # their sum (read every round by the engine's sizer: `row_pace`)
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes verified per round
    tree_depths: list[int] = field(default_factory=list)  # deepest draft node per round
    batch_live: list[int] = field(default_factory=list)  # sequences verified together per round
    model_rounds: int = 0
    accepted_by_source: dict[str, int] = field(
        default_factory=lambda: {"head": 0, "context": 0, "job_cache": 0, "grammar": 0})
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    wall_seconds: float = 0.0

    def record_round(self, accepted: int, tree_size: int, tree_depth: int,
                     accepted_sources: dict[str, int] | None = None, *, live: int = 1,
                     model_ran: bool = False) -> None:
        """One verification round; `accepted_sources`: accepted draft tokens per source name;
        `live`: sequences in the verify forward; `model_ran`: the drafter's model ran for it."""
        self.batch_live.append(live)
        self.model_rounds += bool(model_ran)
        for source, count in (accepted_sources or {}).items():
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + count
        self.accept_lengths.append(accepted)
        self.accepted_tokens += accepted
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

    @property
    def mean_batch_live(self) -> float:
        return sum(self.batch_live) / len(self.batch_live) if self.batch_live else 0.0

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

    def to_row(self) -> dict:
        """The statistics as one flat row: exactly the keys of STAT_COLUMNS, in that order."""
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_histogram": self.acceptance_histogram(),
            "per_position_acceptance": self.per_position_acceptance(),
            "mean_tree_size": self.mean_tree_size,
            "mean_batch_live": self.mean_batch_live,
            "model_rounds": self.model_rounds,
            "accepted_head": self.accepted_by_source.get("head", 0),
            "accepted_context": self.accepted_by_source.get("context", 0),
            "accepted_job_cache": self.accepted_by_source.get("job_cache", 0),
            "accepted_grammar": self.accepted_by_source.get("grammar", 0),
            **{f"{stage}_s": self.stage_seconds[stage] for stage in STAGES},
            "wall_s": self.wall_seconds,
            "tokens_per_s": self.tokens_per_second,
        }

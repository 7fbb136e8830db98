"""What the cost model is off by where the sizer acts: one online ratio per side (gain, seconds)."""

from __future__ import annotations

from dataclasses import dataclass

# `OnlineBias`: pseudo-rounds at "the model was right" (ratio 1), the weight left to older rounds'
# evidence at each new tree round, and the range of the correction.
BIAS_PRIOR_ROUNDS = 2.0
BIAS_MEMORY = 0.97
BIAS_RANGE = (0.25, 4.0)


@dataclass
class OnlineBias:
    """What one side of the cost model is off by on the rounds it chose trees for: observed over
    predicted (accepted nodes over expected, or a tree's extra verify seconds over its predicted
    extra), over recent tree rounds, shrunk toward 1 by BIAS_PRIOR_ROUNDS.

    Both sides are biased exactly where the sizer acts, and neither table sees it alone. A sizer
    verifies the trees it rates highest, so its acceptance estimates on them are too high (a
    winner's curse over bins). And a tree's extra rows are priced on grid points that only tree
    rounds correct, and those are rare where trees seldom pay, so their extra cost over a plain
    step can be several times what the curve predicts (docs/benchmarks.md). One ratio per side
    carries what every tree round shows to every size and bin."""

    observed: float = 0.0
    predicted: float = 0.0
    rounds: float = 0.0

    def add(self, observed: float, predicted: float) -> None:
        self.observed = BIAS_MEMORY * self.observed + observed
        self.predicted = BIAS_MEMORY * self.predicted + predicted
        self.rounds = BIAS_MEMORY * self.rounds + 1.0

    @property
    def ratio(self) -> float:
        if self.predicted <= 0:
            return 1.0
        measured = min(max(self.observed / self.predicted, BIAS_RANGE[0]), BIAS_RANGE[1])
        return (self.rounds * measured + BIAS_PRIOR_ROUNDS) / (self.rounds + BIAS_PRIOR_ROUNDS)


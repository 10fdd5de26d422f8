"""Step pacing: while streams decode, a step carries only as much prefill as keeps it within
``slowdown`` times the time of a step of the decodes alone (Sarathi-Serve's latency-bounded
chunk, with the bound measured instead of assumed).

The scheduler's budget counts compute (cost units: a prefill token is 1 plus its attention at
the model's FLOP ratio). What a unit costs in time is not constant: the attention kernels run
at a lower FLOP rate than the linear layers, deep chunks are memory-bound, and the machine
drifts. So the pacer learns the step time online from the engine's own steps,

    seconds ~= base + per_decode * decode_rows + per_unit * prefill_units,

by recursive least squares with forgetting (recent steps count most: a prompt being prefilled
gets deeper, the batch changes), and answers how many prefill units the next step may carry:
``(slowdown - 1) * (base + per_decode * decodes) / per_unit``. Until it has seen enough steps
to trust the fit it answers None (the token budget alone applies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# how fast old steps are forgotten: a step's weight halves after ~14 steps
FORGETTING = 0.95
# steps seen before the fit is used; and the fit is used only when it is physical (every
# coefficient positive), which needs steps both with and without prefill
MIN_STEPS = 8
# a fresh estimate's variance: large, so the first steps set the coefficients
PRIOR_VARIANCE = 1e4


def _zeros() -> list[list[float]]:
    return [[PRIOR_VARIANCE if i == j else 0.0 for j in range(3)] for i in range(3)]


@dataclass(slots=True)
class StepPacer:
    """Online model of a CPU step's time; caps the prefill of steps that carry decodes.

    ``slowdown``: a step with decodes takes at most this many times the decodes' own step
    (> 1; 2.0 = the inter-token latency of running streams at most doubles while prompts are
    prefilled beside them).
    """

    slowdown: float
    theta: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    cov: list[list[float]] = field(default_factory=_zeros)
    steps: int = 0
    prefill_steps: int = 0
    decode_only_steps: int = 0

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"slowdown must be > 1, got {self.slowdown}")

    def observe(self, decode_rows: int, prefill_units: float, seconds: float) -> None:
        """Fold one executed step into the fit (recursive least squares, forgetting)."""
        x = (1.0, float(decode_rows), float(prefill_units))
        px = [sum(self.cov[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = FORGETTING + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        error = seconds - sum(self.theta[i] * x[i] for i in range(3))
        self.theta = [self.theta[i] + gain[i] * error for i in range(3)]
        self.cov = [[(self.cov[i][j] - gain[i] * px[j]) / FORGETTING for j in range(3)]
                    for i in range(3)]
        self.steps += 1
        self.prefill_steps += prefill_units > 0
        self.decode_only_steps += prefill_units == 0 and decode_rows > 0

    def prefill_units(self, decodes: int) -> float | None:
        """Prefill units the next step may carry beside ``decodes`` decode rows; None while
        the fit is not trusted (too few steps, or not yet seen both kinds of step)."""
        base, per_decode, per_unit = self.theta
        if (self.steps < MIN_STEPS or not self.prefill_steps or not self.decode_only_steps
                or per_unit <= 0):
            return None
        decode_step = base + per_decode * decodes
        if decode_step <= 0:
            return None
        return (self.slowdown - 1.0) * decode_step / per_unit

"""Step pacing: while streams decode, a step carries only as much prefill as keeps it within
``slowdown`` times the time of a step of the decodes alone (Sarathi-Serve's latency-bounded
chunk, with the bound measured instead of assumed).

The scheduler's budget counts compute (cost units: a prefill token is 1 plus its attention at
the model's FLOP ratio). What a unit costs in time is not constant: the attention kernels run
at a lower FLOP rate than the linear layers, a deep chunk is memory-bound, and the machine
drifts. So the pacer measures, from the engine's own steps:

  * the decodes' own step: a moving average of the time of steps without prefill (the batch
    of running streams changes slowly, and a step's fixed part, the weights streamed once,
    dominates it at the batch sizes a CPU runs);
  * what a prefill unit adds: over the steps that carry both, the time they took beyond the
    decodes' step divided by the units they carried, both summed with exponential forgetting
    (a ratio of sums: a step with a token or two of prefill, whose excess is mostly noise,
    weighs as little as its units), so it follows a prompt getting deeper.

and answers how many prefill units the next step may carry:
``(slowdown - 1) * decode_s / unit_s``. Until it has seen both kinds of step it answers None
(the token budget alone applies).
"""

from __future__ import annotations

from dataclasses import dataclass

# weight of the newest step in each moving average: the last ~5 steps count most, so a prompt
# that is prefilled deeper step after step is tracked within a few steps
SMOOTHING = 0.3
# a step's excess over the decodes' step counts at most this many times the current estimate
SPIKE = 3.0


@dataclass(slots=True)
class StepPacer:
    """Online model of a step's time; caps the prefill of steps that carry decodes.

    ``slowdown``: a step with decodes takes at most this many times the decodes' own step
    (> 1; 2.0 = the inter-token latency of running streams at most doubles while prompts are
    prefilled beside them).
    """

    slowdown: float
    decode_s: float = 0.0  # a step of decodes alone (moving average)
    added_s: float = 0.0  # time steps with prefill took beyond decode_s (forgetting sum)
    added_units: float = 0.0  # the prefill units they carried (forgetting sum)

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"slowdown must be > 1, got {self.slowdown}")

    def observe(self, decode_rows: int, prefill_units: float, seconds: float) -> None:
        """Fold one executed step into the averages."""
        if decode_rows and not prefill_units:
            self.decode_s = _average(self.decode_s, seconds)
        elif decode_rows and self.decode_s:
            added = seconds - self.decode_s
            if self.unit_s:
                # a stall from outside the step (another process, a collection) is not what
                # its prefill costs: one step moves the estimate at most SPIKE-fold
                added = min(added, SPIKE * self.unit_s * prefill_units)
            self.added_s = (1 - SMOOTHING) * self.added_s + SMOOTHING * added
            self.added_units = (1 - SMOOTHING) * self.added_units + SMOOTHING * prefill_units

    @property
    def unit_s(self) -> float:
        """What one prefill unit adds to a step's time (0 = not measured yet)."""
        return self.added_s / self.added_units if self.added_s > 0 else 0.0

    def prefill_units(self, decodes: int) -> float | None:
        """Prefill units the next step may carry beside ``decodes`` decode rows; None until
        both a step of decodes alone and a step with prefill beside decodes were measured."""
        if not decodes or not self.decode_s or not self.unit_s:
            return None
        return (self.slowdown - 1.0) * self.decode_s / self.unit_s


def _average(old: float, new: float) -> float:
    return new if not old else (1 - SMOOTHING) * old + SMOOTHING * new

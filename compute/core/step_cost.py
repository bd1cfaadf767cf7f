"""How long a step will take, from its tokens and its attention work, fitted as steps run.

A step's time on a model is close to ``c0 + c1 * tokens + c2 * pairs``: a fixed cost (launches,
sampling, Python), the matmuls every token pays, and attention, which a token at context
``ctx`` pays per key it reads (``pairs``: the query-key pairs of the step; a chunk of n prompt
tokens after ctx computed ones reads n * ctx + n * (n + 1) / 2 of them, a decode ctx + 1).
A late chunk of a long prompt therefore costs more than an early one of the same size, which
a token budget alone does not see.

``StepCost`` fits the three coefficients by recursive least squares with forgetting over the
steps the engine reports (``observe``), so it follows the machine as it is (threads, other
load, a warm or cold cache) without a calibration run; the scheduler asks ``tokens_within``
how many tokens of a chunk fit a step-time target (``SchedulerConfig.max_step_ms``). Until a
few steps are seen it has no estimate, and nothing is capped. Pure Python, no torch.
"""

from __future__ import annotations

# Feature scales, so the three coefficients are of similar size (ms per unit).
_TOKENS = 1e-3  # per thousand tokens
_PAIRS = 1e-6  # per million query-key pairs
_FORGET = 0.98  # each step's weight decays by this per later step
_MIN_STEPS = 4  # steps seen before an estimate is given


def pairs_of(num_new_tokens: int, context: int) -> int:
    """Query-key pairs of ``num_new_tokens`` queries after ``context`` computed tokens."""
    n = num_new_tokens
    return n * context + n * (n + 1) // 2


class StepCost:
    """An online fit of a step's milliseconds against (1, tokens, pairs)."""

    def __init__(self) -> None:
        self.coef = [0.0, 0.0, 0.0]
        self._p = [[1e4 if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.steps = 0

    @property
    def ready(self) -> bool:
        return self.steps >= _MIN_STEPS

    def estimate_ms(self, tokens: int, pairs: int) -> float:
        x = (1.0, tokens * _TOKENS, pairs * _PAIRS)
        return sum(c * v for c, v in zip(self.coef, x, strict=True))

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """One step that computed ``tokens`` tokens over ``pairs`` pairs in ``seconds``."""
        x = (1.0, tokens * _TOKENS, pairs * _PAIRS)
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        gain_den = _FORGET + sum(x[i] * px[i] for i in range(3))
        gain = [v / gain_den for v in px]
        error = seconds * 1e3 - self.estimate_ms(tokens, pairs)
        # Coefficients stay >= 0: no part of a step takes negative time.
        self.coef = [max(0.0, c + g * error) for c, g in zip(self.coef, gain, strict=True)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / _FORGET for j in range(3)] for i in range(3)]
        self.steps += 1

    def tokens_within(
        self, target_ms: float, tokens: int, pairs: int, context: int, most: int
    ) -> int:
        """The most tokens (<= ``most``) a chunk after ``context`` computed tokens may add
        to a step already holding ``tokens`` and ``pairs`` and stay within ``target_ms``;
        ``most`` when there is no estimate yet."""
        if not self.ready:
            return most
        lo, hi = 0, most
        while lo < hi:  # the estimate grows with n: the largest n that fits
            mid = (lo + hi + 1) // 2
            if self.estimate_ms(tokens + mid, pairs + pairs_of(mid, context)) <= target_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

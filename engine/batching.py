"""The core's batching window: whether work reaching an idle engine waits for the rest of its
burst, and how long (the core's `_coalesce` waits; `BurstWindow` says whether it should)."""

from __future__ import annotations

COALESCE_GAP_S = 0.001  # requests arriving this close together share a batch
COALESCE_MAX_S = 0.005
LONE_STARTS = 4  # this many lone requests in a row on an idle engine turn the window off


class BurstWindow:
    """Whether work reaching an idle engine waits for the rest of its burst.

    The wait is worth it for bursts: a burst split over two steps pays one more step (vLLM) or
    one more whole `generate` (transformers). A lone request pays one empty gap for nothing. So
    the engine watches what its idle starts were: one that took a single request, with nothing
    more arriving during its first step, was lone. After `LONE_STARTS` lone starts in a row the
    window is skipped. The first start that was not lone (with the window off, a burst whose
    late members arrived during its first step: a split) turns it back on. A workload that
    changes from lone requests to bursts pays one split.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.lone_in_a_row = 0
        self._first_step: int | None = None  # requests the start took, until its step is seen

    @property
    def wanted(self) -> bool:
        return self.enabled and self.lone_in_a_row < LONE_STARTS

    def started(self, taken: int) -> None:
        """An idle engine took `taken` requests (after the window, if it waited) and steps."""
        if self.enabled:
            self._first_step = taken

    def first_step_done(self, arrived: int) -> None:
        """The loop turn after a start's first step: `arrived` requests came in during it."""
        if self._first_step is None:
            return
        lone = self._first_step + arrived <= 1
        self.lone_in_a_row = self.lone_in_a_row + 1 if lone else 0
        self._first_step = None

"""A replica's own waiting queue being full (its 429, `--max-waiting`): which requests may go there
until it has room again. An engine's queue limit may be below any `Saturation` threshold (0 is
common), so its load alone does not tell the gateway it is full."""

from __future__ import annotations

from dataclasses import dataclass

from corral_gateway.load import LoadSample


@dataclass(slots=True)
class Refusal:
    """After a refusal, a request goes there only into a place freed since (one of this gateway's
    requests there ending), so a freed place takes one queued request, not all of them. The
    refusal ends once its Retry-After has passed with nothing of this gateway's there, or once a
    later load sample shows more room than the places this gateway already knows were freed."""

    until_s: float | None = None  # its Retry-After, from the last refusal; None: not refusing
    at_s: float = 0.0  # when it refused
    num_held: float | None = None  # requests it held (running + waiting) as it refused, if it said
    num_open: int = 0  # refused requests whose lease is not given back yet
    num_freed: int = 0  # places freed there since it refused, not yet taken

    def refused(self, now_s: float, until_s: float, num_held: float | None) -> None:
        self.until_s, self.at_s, self.num_held = until_s, now_s, num_held
        self.num_open += 1
        self.num_freed = 0

    def is_refusing(self, now_s: float, num_inflight: int) -> bool:
        if self.until_s is None or self.num_freed:
            return False
        return now_s < self.until_s or num_inflight > 0  # a request there ending frees a place

    def on_dispatch(self) -> None:
        if self.until_s is None:
            return
        if self.num_freed:
            self.num_freed -= 1
        else:  # sent with no place freed: the refusal had run out
            self.until_s = None

    def on_done(self) -> None:
        if self.num_open:
            self.num_open -= 1  # a refused request's lease: it freed nothing
        elif self.until_s is not None:
            self.num_freed += 1

    def on_sample(self, sample: LoadSample) -> None:
        if self.until_s is None or self.num_held is None or sample.at_s <= self.at_s:
            return
        # A poll between one of ours ending and the next send sees the place that freed, which
        # lets one request through already: only a place beyond those says others' requests ended.
        if sample.num_running + sample.num_waiting < self.num_held - self.num_freed:
            self.until_s = None  # others' requests there ended: it has room

"""When to plan the next overlapped step: as late as the step on the device allows.

Under the overlap scheduler step k + 1 is planned and queued while step k computes. Planned as soon
as step k - 1 is read back, it misses every request that arrives while step k computes: those wait
for step k + 2, a whole step more (about 50 ms for a 2,048-token step of the 8B shape). Planned just
before step k ends, it takes them, and the device waits for the host only where the host's work
is near the device's step (FP8 at 256 streams, where it cost through Serve: off by default,
EngineConfig.late_planning).

The clock learns how long the device takes for a step of a given size (the time between two steps'
ends, for steps queued while the one before was still computing), and how much of a lead the host
needs: the time from starting to plan a step until its first kernel is queued, plus, where queuing
the rest of it takes the host longer than the device takes to compute it, the difference (else the
device would catch up with the host and wait). On an H200 a 2,048-token step of the 8B shape computes
for about 50 ms, and the host takes about 7 ms to plan it and about 32 ms more to queue its kernels one by
one: it is planned about 9 ms before the step computing ends, not 41. The serving loops go on taking
requests until `seconds_to_plan` reaches 0. Without a measured step of the in-flight step's size
(the first steps, or off CUDA) it says 0: plan now, as without the clock.
"""
from __future__ import annotations

import collections
import time

RECENT = 8  # steps remembered per size (and the host's leads)
HOST_SAFETY_S = 0.002  # on top of the largest recent lead: the host's wake-up, a late command, uneven queuing
ANCHOR_S = 1.0  # a waited-for stamp is replaced by a later one after this long: the two clocks drift apart


class StepClock:
    def __init__(self):
        # Device seconds of recent steps by size (tokens' bit length: steps of 128-255 tokens share one).
        # The shortest of them is the estimate: planning early costs an arrival one step, planning late
        # idles the device.
        self._device_s: dict[int, collections.deque] = {}
        # One lead for every size (the next step's size is not known yet): after a 2,048-token step's
        # long lead, small steps are planned early, which errs on the safe side.
        self._leads_s: collections.deque = collections.deque(maxlen=RECENT)
        self._plan_at: float | None = None
        self._anchor = None  # the read back step whose `finished_at` stamp is nearest its end (see ended_at)
        self.queued = 0  # steps queued behind one still computing
        # Of them, those whose step before had already ended when their first kernel was queued: the
        # device waited. A wait later in a step queued op by op (the device catching up with the host
        # mid-step) is not counted.
        self.queued_late = 0

    def planned(self, tokens: int, to_forward_s: float, forward_s: float, late: bool) -> None:
        """A step of `tokens` was queued behind another (which had already ended if `late`): the host
        took `to_forward_s` from starting to plan it until its first kernel was queued, then `forward_s`
        to queue the rest."""
        expected = self._expected_s(tokens)
        behind = forward_s if expected is None else max(0.0, forward_s - expected)  # where the device would catch up
        self._leads_s.append(to_forward_s + behind)
        self.queued += 1
        self.queued_late += late

    def timed(self, tokens: int, device_s: float) -> None:
        """A step of `tokens` kept the device busy for `device_s`."""
        self._device_s.setdefault(tokens.bit_length(), collections.deque(maxlen=RECENT)).append(device_s)

    def ended_at(self, sample) -> float:
        """When (time.monotonic()) the device finished a step just read back (its DeviceSample).
        The host's stamp of a wait for it (`finished_at`) comes a wake-up late, and a step the host
        did not wait for has none: the host may have been queuing the next step long after it ended.
        So the end is counted on the device's clock from the stamp that implies the earliest ends
        (stamps are never early), replaced after ANCHOR_S by the next stamp; off CUDA it is now."""
        anchor = self._anchor
        since = sample.device_seconds_since(anchor) if anchor is not None else None
        stamp = sample.finished_at
        if stamp is not None and (since is None or stamp <= anchor.finished_at + since or since > ANCHOR_S):
            self._anchor = sample
            return stamp
        return time.monotonic() if since is None else anchor.finished_at + since

    def started(self, tokens: int, at: float) -> None:
        """A step of `tokens` is on the device since about `at` (time.monotonic())."""
        expected = self._expected_s(tokens)
        self._plan_at = None if expected is None else at + expected - max(self._leads_s, default=0.0) - HOST_SAFETY_S

    def _expected_s(self, tokens: int) -> float | None:
        recent = self._device_s.get(tokens.bit_length())
        return min(recent) if recent else None

    def stopped(self) -> None:
        """Nothing is on the device: the next step is planned at once."""
        self._plan_at = None

    def seconds_to_plan(self, now: float) -> float:
        return 0.0 if self._plan_at is None else max(0.0, self._plan_at - now)

    @property
    def estimates(self) -> dict[int, float]:
        """The device seconds expected of a step, by the smallest token count of its size."""
        return {1 << (size - 1) if size else 0: min(times) for size, times in sorted(self._device_s.items())}


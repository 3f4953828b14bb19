"""Submissions: record once, evaluate many times, and read the GPU time they took.

Two ways work reaches the queue:

* :class:`Recording` — a kp.Sequence recorded ONCE and evaluated again and again (the
  same commands each time: Kompute bakes push constants into the command buffer at record
  time, so per-call values must live in buffers). With ``timestamps`` it latches a
  timestamp before the first op and after the ops it reads: ``"spans"`` (or True) before
  the ``core`` ops' first op and after their last, around the ``untimed`` ones and after the
  last op — so no timestamp falls inside a timed span (each waits for the work before it:
  scripts/kp_patch.py item 3); ``"ops"`` after every op
  (:meth:`Recording.op_seconds`, for probes). :meth:`Recording.gpu_seconds` gives the last
  run's GPU time (first to last, in the device's timestampPeriod, masked by the queue's
  timestampValidBits; less the ``untimed`` ops, put there for the timing's sake),
  :meth:`Recording.core_seconds` that of its ``core`` ops.
* :meth:`Submitter.submit` — record these ops and evaluate them once, on a sequence the
  device keeps and records again (``Device.submit``; kernels.run). Kompute 0.9.0 made a new
  sequence — a command pool, a command buffer, a fence — for every call, hundreds of µs a
  call on a GPU. scripts/kp_patch.py makes a sequence cheap to clear and re-record and
  to evaluate again (one fence, reset and polled).

Both go through Device.guard, which serialises every Kompute call on a device.
"""
from __future__ import annotations

import kp

from .. import errors as E

# scripts/kp_patch.py item 3 (a stock kp latches a timestamp after every op)
HAS_UNLATCHED = hasattr(kp.Sequence, "record_unlatched")


def timestamps_usable(device) -> bool:
    """Whether the device's compute queue writes timestamps we can turn into seconds."""
    lim = device.info.limits
    return bool(lim.get("timestamp_compute_and_graphics")) and lim.get("timestamp_period_ns", 0) > 0 \
        and lim.get("timestamp_valid_bits", 0) > 0


def device_kind(device) -> str:
    """"cpu" for a software driver (lavapipe, SwiftShader), "gpu" otherwise."""
    return "cpu" if device.is_cpu else "gpu"


def ticks_to_seconds(device, start: int, end: int) -> float:
    """GPU seconds between two raw timestamps (valid bits only, wrap-around safe)."""
    bits = device.info.limits["timestamp_valid_bits"]
    mask = (1 << bits) - 1 if bits < 64 else (1 << 64) - 1
    return ((int(end) - int(start)) & mask) * float(device.info.limits["timestamp_period_ns"]) * 1e-9


class Recording:
    """``ops`` recorded once into their own sequence; :meth:`run` evaluates them again.

    The ops (and what they bind) must outlive the recording; it keeps references to them.
    """

    def __init__(self, device, ops, *, timestamps: bool | str = False, what: str = "dispatch", core=None,
                 untimed=None):
        """``core`` = (first, stop): ops[first:stop] are the work itself (an attention's
        passes, without the copies of its query up and its output back), timed by
        :meth:`core_seconds`; default all of them. ``untimed`` = (first, stop): ops there for
        the timing's sake (an L2 flush, a priming run of the core), left out of
        :meth:`gpu_seconds`; they must come before the core. ``timestamps``: False, "spans"
        (True) or "ops" (the module's docstring)."""
        self.device, self.what = device, what
        self._ops = list(ops)
        self.core = (0, len(self._ops)) if core is None else tuple(core)
        if not 0 <= self.core[0] < self.core[1] <= len(self._ops):
            raise E.DispatchError(f"{what}: core ops {self.core} outside the {len(self._ops)} ops")
        self.untimed = None if untimed is None or untimed[0] == untimed[1] else tuple(untimed)
        if self.untimed is not None and not 0 <= self.untimed[0] < self.untimed[1] <= self.core[0]:
            raise E.DispatchError(f"{what}: untimed ops {self.untimed} must come before the core ops {self.core}")
        if not self._ops:
            raise E.DispatchError(f"{what}: a recording needs at least one operation")
        if timestamps not in (False, True, "spans", "ops"):
            raise E.DispatchError(f"{what}: timestamps must be False, 'spans' or 'ops', got {timestamps!r}")
        self.timestamps = bool(timestamps) and timestamps_usable(device)
        # the ops a timestamp follows; the timestamps read back: before op 0, then one for each
        every = timestamps == "ops" or not HAS_UNLATCHED
        spans = {*self.core, *(self.untimed or ()), len(self._ops)} - {0}
        stops = set(range(1, len(self._ops) + 1)) if every else spans
        self._latched = sorted(stops) if self.timestamps else []
        self._ran = False
        with device.guard(f"recording {what}"):
            self._seq = device.manager.sequence(0, len(self._latched))
            for i, op in enumerate(self._ops, 1):
                if i in stops:  # every op where kp cannot leave one out
                    self._seq.record(op)
                else:
                    self._seq.record_unlatched(op)

    def run(self) -> None:
        """Submit the recorded commands and wait for them."""
        if self._seq is None:
            raise E.DispatchError(f"{self.what}: the recording was freed")
        with self.device.guard(self.what):
            self._seq.eval()
        self._ran = True

    def _timestamps(self) -> dict | None:
        """The last :meth:`run`'s timestamps by the number of ops before them (0: before the
        first op), or None (no timestamps on this device, never run, or freed)."""
        if not (self.timestamps and self._ran and self._seq is not None):
            return None
        with self.device.guard(f"reading the timestamps of {self.what}"):
            ts = self._seq.get_timestamps()
        return dict(zip([0, *self._latched], ts))

    def _span_seconds(self, first: int, stop: int) -> float | None:
        """GPU time of the last :meth:`run`'s ops[first:stop] (None: see _timestamps)."""
        ts = self._timestamps()
        if ts is None:
            return None
        if first not in ts or stop not in ts:
            raise E.DispatchError(f"{self.what}: no timestamps around ops [{first}, {stop}) (timestamps='ops' "
                                  f"latches after every op)")
        return ticks_to_seconds(self.device, ts[first], ts[stop])

    def gpu_seconds(self) -> float | None:
        """GPU time of the last :meth:`run`, every op but the ``untimed`` ones (None: no
        timestamps on this device, or never run)."""
        total = self._span_seconds(0, len(self._ops))
        if total is None or self.untimed is None:
            return total
        return total - self._span_seconds(*self.untimed)

    def core_seconds(self) -> float | None:
        """GPU time of the last :meth:`run`'s core ops (see ``core``)."""
        return self._span_seconds(*self.core)

    def op_seconds(self) -> list[float] | None:
        """GPU time of each op of the last run (timestamp after it minus the one before;
        timestamps="ops")."""
        ts = self._timestamps()
        if ts is None:
            return None
        if len(ts) <= len(self._ops):
            raise E.DispatchError(f"{self.what}: per-op times need timestamps='ops'")
        return [ticks_to_seconds(self.device, ts[i], ts[i + 1]) for i in range(len(self._ops))]

    def free(self) -> None:
        if self._seq is not None:
            with self.device.guard(f"freeing the recording of {self.what}"):
                self._seq.destroy()
            self._seq = None
            self._ops = []

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, *exc) -> None:
        self.free()


class Submitter:
    """One reusable sequence of a device: each :meth:`submit` clears it, records the ops
    and evaluates them (the caller holds the device's guard while it does)."""

    def __init__(self, device):
        self.device = device
        self._seq = None

    def submit(self, ops, what: str) -> None:
        ops = list(ops)
        if not ops:
            return
        with self.device.guard(what):
            if self._seq is None:
                self._seq = self.device.manager.sequence()
            seq = self._seq
            seq.clear()  # ends a recording an earlier failure left open, drops the old ops
            try:
                for op in ops:
                    seq.record(op)
                seq.eval()
            finally:
                seq.clear()  # no references to these ops (and their buffers) stay behind

    def free(self) -> None:
        if self._seq is not None:
            with self.device.guard("freeing the submission sequence"):
                self._seq.destroy()
            self._seq = None

"""The status watermark valve: a task's watermark over its input channels."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from spillover.runtime.eventtime.valve import StatusWatermarkValve
from spillover.runtime.network.events import MIN_WATERMARK, Watermark, WatermarkStatus

CHANNELS = 4
TS = st.integers(-50, 1000)
WATERMARKS = st.tuples(st.just("wm"), st.integers(0, CHANNELS - 1), TS)
OPS = st.one_of(
    WATERMARKS,
    st.tuples(st.just("idle"), st.integers(0, CHANNELS - 1), st.booleans()),
    st.tuples(st.just("end"), st.integers(0, CHANNELS - 1), st.just(0)),
)


def apply(valve: StatusWatermarkValve, op: tuple[str, int, Any]) -> list[Any]:
    kind, ch, arg = op
    if kind == "wm":
        return valve.on_watermark(ch, arg)
    if kind == "idle":
        return valve.on_status(ch, arg)
    return valve.on_end(ch)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(WATERMARKS, st.tuples(st.just("end"), st.integers(0, 3), st.just(0)))))
def test_without_idleness_the_output_is_the_min_over_channels_not_ended(ops: list[Any]) -> None:
    valve = StatusWatermarkValve(CHANNELS)
    wm = [MIN_WATERMARK] * CHANNELS
    ended: set[int] = set()
    emitted: list[int] = []
    for op in ops:
        before = valve.watermark
        out = apply(valve, op)
        kind, ch, ts = op
        if kind == "wm" and ch not in ended:
            wm[ch] = max(wm[ch], ts)
        elif kind == "end":
            ended.add(ch)
        assert all(isinstance(e, Watermark) for e in out)
        emitted += [e.timestamp_ms for e in out]
        live = [wm[c] for c in range(CHANNELS) if c not in ended]
        if live:
            assert valve.watermark == max(before, min(live))
        if not ended:
            assert valve.watermark == min(wm)
    assert emitted == sorted(set(emitted)), "strictly increasing, emitted only when advancing"
    if emitted:
        assert valve.watermark == emitted[-1]


class Model:
    """Flink's rules written out plainly, channel by channel."""

    def __init__(self, n: int) -> None:
        self.wm = [MIN_WATERMARK] * n
        self.idle = [False] * n
        self.aligned = [True] * n
        self.ended = [False] * n
        self.out = MIN_WATERMARK
        self.out_idle = False

    def active(self) -> list[int]:
        return [c for c in range(len(self.wm)) if not self.ended[c] and not self.idle[c]]

    def settle(self) -> None:
        for c in self.active():
            if self.wm[c] >= self.out:
                self.aligned[c] = True
        holding = [self.wm[c] for c in self.active() if self.aligned[c]]
        if holding:
            self.out = max(self.out, min(holding))

    def step(self, op: tuple[str, int, Any]) -> None:
        kind, ch, arg = op
        if self.ended[ch]:
            return
        live = [c for c in range(len(self.wm)) if not self.ended[c]]
        if kind == "wm":
            if not self.idle[ch]:
                self.wm[ch] = max(self.wm[ch], arg)
        elif kind == "idle" and arg != self.idle[ch]:
            self.idle[ch] = arg
            if arg:
                self.aligned[ch] = False
                if not self.active():
                    if self.wm[ch] == self.out:
                        self.out = max([self.out] + [self.wm[c] for c in live])
                    self.out_idle = True
            else:
                self.aligned[ch] = self.wm[ch] >= self.out
                self.out_idle = False
        elif kind == "end":
            was_idle = self.idle[ch]
            self.ended[ch] = True
            self.idle[ch] = False
            live = [c for c in range(len(self.wm)) if not self.ended[c]]
            if live and not self.active():
                if not was_idle:
                    self.out = max([self.out] + [self.wm[c] for c in live])
                self.out_idle = True
        self.settle()


@settings(max_examples=500, deadline=None)
@given(st.lists(OPS, max_size=60))
def test_idle_channels_and_ended_ones_do_not_hold_the_watermark_back(ops: list[Any]) -> None:
    valve = StatusWatermarkValve(CHANNELS)
    model = Model(CHANNELS)
    last = MIN_WATERMARK
    for op in ops:
        out = apply(valve, op)
        model.step(op)
        for e in out:
            if isinstance(e, Watermark):
                assert e.timestamp_ms > last, "the output never goes back nor repeats"
                last = e.timestamp_ms
            else:
                assert isinstance(e, WatermarkStatus)
        assert valve.watermark == model.out == last
        assert valve.idle == model.out_idle
        # Every active channel that caught up holds it: the output is their minimum.
        active = model.active()
        if active and all(model.aligned[c] for c in active):
            assert valve.watermark == min(model.wm[c] for c in active)


def test_an_idle_channel_stops_holding_back_and_rejoins_once_caught_up() -> None:
    valve = StatusWatermarkValve(2)
    assert valve.on_watermark(0, 10) == []
    assert valve.on_watermark(1, 5) == [Watermark(5)]
    assert valve.on_status(1, True) == [Watermark(10)]  # channel 0 alone holds it
    assert valve.on_watermark(0, 20) == [Watermark(20)]
    assert valve.on_status(1, False) == []  # active again, at 5: not aligned
    assert valve.on_watermark(0, 30) == [Watermark(30)]  # 1 does not hold it back yet
    assert valve.on_watermark(1, 40) == []  # caught up: aligned again
    assert valve.on_watermark(0, 50) == [Watermark(40)]
    assert valve.on_status(0, True) == []  # 1 holds it at 40
    assert valve.on_status(1, True) == [Watermark(50), WatermarkStatus(True)]
    assert valve.on_status(0, False) == [WatermarkStatus(False)]


def test_a_drained_channel_no_longer_holds_back() -> None:
    valve = StatusWatermarkValve(2)
    valve.on_watermark(0, 100)
    assert valve.on_watermark(1, 7) == [Watermark(7)]
    assert valve.on_end(1) == [Watermark(100)]
    assert valve.on_end(0) == []

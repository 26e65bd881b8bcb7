"""progress.track: tqdm bar on a terminal, periodic status lines otherwise, silence when quiet."""

import io

import pytest

from icqs_fast.progress import Progress, format_duration, status_line, track


class FakeClock:
    """Monotonic seconds advancing by ``step`` on every call."""

    def __init__(self, step: float):
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_tty_prints_periodic_lines_with_rate_and_eta():
    out = io.StringIO()
    # The clock moves 1 s per call (one call at the start, one per item): a line every
    # 4 items with interval 4.
    items = list(track(range(10), desc="score", unit="record", interval=4.0, stream=out,
                       clock=FakeClock(1.0)))
    assert items == list(range(10))
    lines = out.getvalue().splitlines()
    # After item 4 (t=5, elapsed 4 s: 1.0 record/s, 6 left -> ETA 6s) and item 8, then done.
    assert lines == [
        "score: 4/10 records (1.0 records/s, ETA 6s)",
        "score: 8/10 records (1.0 records/s, ETA 2s)",
        "score: 10/10 records (0.9 records/s, done in 11s)",
    ]


def test_not_a_tty_unknown_total_and_short_run_silent():
    out = io.StringIO()
    gen = (i for i in range(6))  # no len(): no total, no ETA
    assert sum(track(gen, interval=2.5, stream=out, clock=FakeClock(1.0))) == 15
    assert out.getvalue().splitlines()[0] == "3 items (1.0 items/s)"
    # A run shorter than the interval prints nothing at all.
    quiet_out = io.StringIO()
    assert list(track([1, 2, 3], stream=quiet_out, clock=FakeClock(0.001))) == [1, 2, 3]
    assert quiet_out.getvalue() == ""


def test_tty_draws_tqdm_bar():
    out = FakeTTY()
    assert list(track(range(25), total=25, desc="features", unit="item", stream=out)) == \
        list(range(25))
    text = out.getvalue()
    assert "features" in text and "25/25" in text and "item/s" in text


def test_quiet_prints_nothing_on_either_stream():
    for out in (FakeTTY(), io.StringIO()):
        assert list(track(range(50), quiet=True, interval=0.0, stream=out)) == list(range(50))
        assert out.getvalue() == ""


def test_default_stream_is_stderr_at_call_time(capsys):
    list(track(range(3), desc="x", interval=0.0, clock=FakeClock(1.0)))
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "x: 1/3 items (1.0 items/s, ETA 2s)"


def test_early_break_closes_the_bar():
    out = FakeTTY()
    for i in track(range(100), stream=out):
        if i == 5:
            break
    assert "6/100" in out.getvalue() or "5/100" in out.getvalue()


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (61, "1m01s"),
                                           (3725, "1h02m"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_status_line_units():
    assert status_line(1, 2.0, total=4, unit="item") == "1/4 items (0.5 items/s, ETA 6s)"
    assert status_line(3, 0.0, unit="pairs") == "3 pairs (0.0 pairs/s)"


def test_progress_manual_updates_and_env_interval(monkeypatch):
    out = io.StringIO()
    # The clock moves 1 s per call: one at the start, one per update.
    with Progress(total=30, desc="eval", unit="answer", interval=2.0, stream=out,
                  clock=FakeClock(1.0)) as p:
        for _ in range(3):
            p.update(10)
    assert p.count == 30
    assert out.getvalue().splitlines() == ["eval: 20/30 answers (10.0 answers/s, ETA 1s)",
                                           "eval: 30/30 answers (7.5 answers/s, done in 4s)"]
    monkeypatch.setenv("ICQS_FAST_PROGRESS_INTERVAL", "3")
    out = io.StringIO()
    list(track(range(7), stream=out, clock=FakeClock(1.0)))
    assert out.getvalue().splitlines()[:2] == ["3/7 items (1.0 items/s, ETA 4s)",
                                               "6/7 items (1.0 items/s, ETA 1s)"]
    monkeypatch.setenv("ICQS_FAST_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="ICQS_FAST_PROGRESS_INTERVAL"):
        list(track(range(2), stream=io.StringIO()))


def test_error_in_the_loop_prints_no_done_line():
    out = io.StringIO()

    def items():
        yield from range(5)
        raise RuntimeError("bad record")

    with pytest.raises(RuntimeError):
        list(track(items(), interval=2.0, stream=out, clock=FakeClock(1.0)))
    lines = out.getvalue().splitlines()
    assert lines and not any("done" in ln for ln in lines)

"""The scheduler's timing rules on a fake clock (no model, no Ray)."""
import pytest

from kvtc.pipeline.operations.schedule import Schedule, Scheduler


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def time(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_next_after_for_every_and_cron():
    assert Schedule(every=10).next_after(1000.0) == 1010.0
    assert Schedule(every=10).next_after(1003.5) == 1010.0
    sec = Schedule(cron="*/1 * * * * *")
    assert sec.next_after(1000.2) == 1001.0 and sec.next_after(1001.0) == 1002.0
    assert Schedule(cron="*/15 * * * * *").next_after(1000.0) == 1005.0  # 1005 = 16 min 45 s; next multiple of 15 s
    minute = Schedule(cron="* * * * *")
    assert minute.next_after(1000.0) == 1020.0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"cron": "* * * * *", "every": 5}, "exactly one"), ({"every": 0}, "positive"),
    ({"cron": "61 * * * *"}, "not a cron expression"), ({"cron": "* * *"}, "not a cron expression"),
])
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)


def test_overrunning_run_skips_missed_fires_and_failures_do_not_stop_it():
    clock = FakeClock(100.5)
    calls = []

    def job() -> int:
        calls.append(clock.t)
        if len(calls) == 1:
            clock.t += 3.5  # outlasts three slots
            return 0
        raise RuntimeError("boom")

    runs = Scheduler(Schedule(every=1), job, max_runs=2, clock=clock.time, sleep=clock.sleep, report=lambda r: None).run()
    assert calls == [101.0, 105.0]  # fires 102..104 were missed and skipped, not replayed
    assert [r["rc"] for r in runs] == [0, 2] and [r["fired_at"] for r in runs] == [101.0, 105.0]


def test_stop_ends_the_loop_after_the_current_run():
    clock = FakeClock(0.0)
    sched = Scheduler(Schedule(every=1), lambda: 0, clock=clock.time, sleep=clock.sleep, report=lambda r: None)
    sched.job = lambda: (sched.stop(), 0)[1]
    assert len(sched.run()) == 1


def test_max_runs_must_be_positive():
    with pytest.raises(ValueError, match="max-runs"):
        Scheduler(Schedule(every=1), lambda: 0, max_runs=0)

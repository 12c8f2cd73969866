"""The interval between a waiting request's reads of its job (api/services/jobs.PollInterval)."""

from pytest import approx

from structspec.api.services.jobs import PollInterval


def test_interval_grows_by_half_without_progress_up_to_the_cap_and_resets_on_progress():
    poll = PollInterval(low=0.05, high=0.25)
    idle = [poll.next(progress=False) for _ in range(6)]
    assert idle == sorted(idle) and idle[0] == approx(0.075) and idle[-1] == 0.25
    assert all(b <= a * 1.5 + 1e-12 for a, b in zip(idle, idle[1:]))
    assert poll.next(progress=True) == 0.05
    assert poll.next(progress=False) == approx(0.075)

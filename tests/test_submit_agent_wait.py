"""dta submit waits (bounded) for a new head's job agent, and raises anything else at once."""
import pytest

from dta_cli import jobs


class FakeClient:
    def __init__(self, errors):
        self.errors, self.calls = list(errors), 0

    def submit_job(self, **job):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "raysubmit_1"


def test_waits_for_the_agent(monkeypatch, capsys):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    agent = RuntimeError("Request failed with status code 500: No available agent to submit "
                         "job, please try again later..")
    client = FakeClient([agent, agent])
    assert jobs._submit(client, entrypoint="x") == "raysubmit_1" and client.calls == 3
    assert capsys.readouterr().err.count("job agent is not up yet") == 1


def test_other_errors_and_a_lasting_absence_are_raised(monkeypatch):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    client = FakeClient([RuntimeError("Request failed with status code 400: bad runtime_env")])
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        jobs._submit(client, entrypoint="x")
    assert client.calls == 1
    monkeypatch.setattr(jobs, "AGENT_WAIT_S", -1.0)  # the wait is bounded
    client = FakeClient([RuntimeError("No available agent to submit job")] * 3)
    with pytest.raises(RuntimeError, match="No available agent"):
        jobs._submit(client, entrypoint="x")
    assert client.calls == 1

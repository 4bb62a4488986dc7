"""A window's validation is claimed on a lease: a validator that dies leaves its job to the next
worker, and a validation done is never done again."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import optuna
import pytest
from _sim import landscape

from autotune.infra import clock
from autotune.schema.spec import parse_spec
from autotune.search import Budget, run_search
from autotune.search._budget import window_id
from autotune.search._coordination import await_validation, validation_job
from autotune.sim import SimulatedRunner
from autotune.study.claims import LEASE, claim, done_by, holding, mark_done, owner_id, renew
from autotune.study.crown import stored_config
from autotune.study.store import StudyStore

DEAD = f"{socket.gethostname()}:999999"  # no such process on this host
ELSEWHERE = "another-box:4242"  # a process this host cannot see


def _study(url: str) -> optuna.Study:
    return optuna.create_study(study_name="v", storage=url, direction="maximize")


@pytest.mark.parametrize("storage_url", ["sqlite", "postgresql"], indirect=True)
def test_a_claim_is_taken_over_only_from_an_owner_that_lost_it(storage_url: str) -> None:
    study = _study(storage_url)
    with clock.use(clock.VirtualClock()):
        assert claim(study, "validation:1", DEAD) == DEAD
        assert claim(study, "validation:1") == owner_id()  # its owner is gone from this host
        assert claim(study, "validation:2", ELSEWHERE) == ELSEWHERE
        clock.sleep(LEASE / 2)
        assert claim(study, "validation:2") == ELSEWHERE  # silent, but within its lease
        clock.sleep(LEASE)
        assert claim(study, "validation:2") == owner_id()  # silent past it
        assert claim(study, "validation:2", ELSEWHERE) == owner_id()  # and now it is ours


@pytest.mark.parametrize("storage_url", ["sqlite"], indirect=True)
def test_a_holder_that_stops_gives_its_claim_up_and_a_done_job_is_not_claimed_again(
    storage_url: str,
) -> None:
    study = _study(storage_url)
    with pytest.raises(RuntimeError), holding(study, "validation:1"):
        assert claim(study, "validation:1") == owner_id()
        raise RuntimeError("drained")
    assert claim(study, "validation:1", ELSEWHERE) == ELSEWHERE  # given up: the next one takes it
    mark_done(study, "validation:1")
    assert done_by(study, "validation:1") == owner_id()
    with clock.use(clock.VirtualClock()):
        clock.sleep(2 * LEASE)  # the holder is long silent, but its job is done
        assert await_validation(StudyStore(study), "1", wait=0.0)[:2] == (False, owner_id())


class _ValidatorDies(SimulatedRunner):
    """Another worker claims the study's validation while this one searches, then dies (or goes
    silent): ``holder`` is who it was."""

    def __init__(self, storage: str, holder: str) -> None:
        super().__init__(landscape())
        self.storage, self.holder, self.claimed = storage, holder, False

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if not self.claimed:
            study = optuna.load_study(study_name="v", storage=self.storage)
            claim(study, validation_job(window_id(StudyStore(study))), self.holder)
            self.claimed = True
        return super().run(*args, **kwargs)


def _search(tmp_path: Path, runner: SimulatedRunner, storage: str) -> Any:
    spec = parse_spec(
        {
            "name": "v",
            "workload": "autotune.workloads:resnet18",
            "budget": "90s",
            "storage": storage,
            "space": {"precisions": ["fp32", "bf16"], "batch_sizes": [64, 256]},
        }
    )
    with clock.use(runner.clock):
        return run_search(spec, out_dir=tmp_path / "out", runner=runner, budget=Budget(90.0))


@pytest.mark.parametrize("holder", [DEAD, ELSEWHERE], ids=["killed", "silent"])
def test_a_worker_validates_in_place_of_a_validator_that_died(tmp_path: Path, holder: str) -> None:
    """kill -9 the worker holding the validation claim (or cut its box off): the next worker to
    reach validation takes it over and the study ends with its config."""
    storage = f"sqlite:///{tmp_path / 's.db'}"
    runner = _ValidatorDies(storage, holder)
    result = _search(tmp_path, runner, storage)
    assert runner.claimed
    assert result.validated_by == owner_id()
    assert result.path is not None and result.path.is_file()
    assert stored_config(result.store.study) is not None
    assert (
        done_by(result.store.study, validation_job(window_id(StudyStore(result.store.study))))
        == owner_id()
    )


def test_a_worker_waits_for_a_live_validator_instead_of_validating_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The validator is alive elsewhere and renews its claim well past a lease: this worker
    validates nothing, and ends once that validation is marked done."""
    import autotune.search._coordination as coordination

    storage = f"sqlite:///{tmp_path / 's.db'}"
    runner = _ValidatorDies(storage, ELSEWHERE)
    looks: list[float] = []
    looked_up = coordination.done_by

    def validator_elsewhere(study: optuna.Study, job: str) -> str | None:
        # Between two looks the validator's own thread renews its claim; it is done after
        # three leases.
        looks.append(clock.now())
        renew(study, job, ELSEWHERE)
        if looks[-1] - looks[0] > 3 * LEASE:
            mark_done(study, job, ELSEWHERE)
        return looked_up(study, job)

    monkeypatch.setattr(coordination, "done_by", validator_elsewhere)
    result = _search(tmp_path, runner, storage)
    assert looks and looks[-1] - looks[0] > 3 * LEASE  # it waited past a lease
    assert result.validated_by == ELSEWHERE
    assert result.path is None  # this worker validated and wrote nothing
    assert stored_config(result.store.study) is None

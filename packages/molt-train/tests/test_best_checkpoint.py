"""Best checkpoint by eval metric, without Ray: stand-in actors write one file per save."""

import json
import math
from pathlib import Path

import pytest

from molt_train.checkpoint import BestTracker, CheckpointManager
from molt_train.cli import parse


class FileActor:
    """What CheckpointManager needs of a ModelGroup: save(path) writes the weights' 'version'."""

    def __init__(self):
        self.version = 0

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "weights.txt").write_text(str(self.version))


def save(manager: CheckpointManager, actor: FileActor, step: int) -> None:
    actor.version = step
    manager.save(step, {"policy": actor}, {"step": step})


def best_weights(manager: CheckpointManager) -> str:
    return (manager.root / "best" / "policy" / "weights.txt").read_text()


def test_an_eval_that_finishes_after_a_refit_is_credited_to_its_version(tmp_path):
    manager, actor = CheckpointManager(str(tmp_path), keep_last=2), FileActor()
    tracker = BestTracker("eval/pass@1", "max")
    save(manager, actor, 10)
    save(manager, actor, 20)  # trained on and refit before the eval of version 10 came back
    assert tracker.update(10, {"eval/pass@1": 0.5})
    manager.promote_best(tracker.version, tracker.state_dict())
    assert best_weights(manager) == "10"  # version 10's weights, not the latest ones
    record = json.loads((tmp_path / "best" / "best.json").read_text())
    assert record == {"metric": "eval/pass@1", "mode": "max", "value": 0.5, "version": 10}

    assert not tracker.update(20, {"eval/pass@1": 0.4})  # worse: best stays on 10
    save(manager, actor, 30)  # prunes step 10: the best copy survives it
    assert not (tmp_path / "step_00000010").exists() and best_weights(manager) == "10"
    assert tracker.update(30, {"eval/pass@1": 0.75})
    manager.promote_best(30, tracker.state_dict())
    assert best_weights(manager) == "30"
    assert sorted(p.name for p in tmp_path.glob("best*")) == ["best", "best_00000030"]


def test_modes_ties_and_missing_values():
    low = BestTracker("eval/loss", "min")
    assert low.update(1, {"eval/loss": 2.0}) and low.update(2, {"eval/loss": 1.0})
    assert not low.update(3, {"eval/loss": 1.0})  # a tie keeps the earlier version
    assert not low.update(4, {"eval/loss": math.nan}) and not low.update(5, {"other": 0.0})
    assert (low.value, low.version) == (1.0, 2)
    restored = BestTracker("eval/loss", "min")
    restored.load_state_dict(low.state_dict())
    assert not restored.update(6, {"eval/loss": 1.5}) and restored.update(7, {"eval/loss": 0.5})
    with pytest.raises(SystemExit):  # the CLI takes max or min only
        parse(["--ckpt.best_mode", "lowest"])


def test_promoting_a_checkpoint_that_is_gone_fails(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=2)
    with pytest.raises(FileNotFoundError):
        manager.promote_best(5, {})
    assert not (tmp_path / "best").exists()


def test_a_crash_mid_promotion_leaves_the_old_best(tmp_path):
    manager, actor = CheckpointManager(str(tmp_path), keep_last=3), FileActor()
    save(manager, actor, 1)
    save(manager, actor, 2)
    manager.promote_best(1, {"version": 1})
    (tmp_path / "best_00000002.tmp").mkdir()  # a copy a crash interrupted
    (tmp_path / "best.tmp").symlink_to("best_00000002.tmp")
    assert best_weights(manager) == "1"
    manager.promote_best(2, {"version": 2})  # the next promotion clears the leftovers
    assert best_weights(manager) == "2"
    assert sorted(p.name for p in tmp_path.glob("best*")) == ["best", "best_00000002"]

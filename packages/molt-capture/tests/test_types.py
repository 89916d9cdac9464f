import json
import pickle

import pytest

from molt_capture import Generation, Rollout, Segment


def _segment() -> Segment:
    seg = Segment(temperature=0.7)
    seg.append_context([1, 2, 3])
    seg.append_generation(
        Generation([4, 5], [-0.1, -0.2], "stop", [7, 7], [[[1, 2]], [[3, 4]]]), 16
    )
    seg.append_context([6])
    return seg


def test_segment_alignment():
    seg = _segment()
    assert seg.token_ids == [1, 2, 3, 4, 5, 6]
    assert seg.trainable == [0, 0, 0, 1, 1, 0]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0]
    assert seg.weight_versions == [-1, -1, -1, 7, 7, -1]
    assert seg.routed_experts == [None, None, None, [[1, 2]], [[3, 4]], None]
    assert seg.num_generated == 2 and seg.turns[0].start == 3 and seg.turns[0].end == 5


def test_rollout_round_trips_through_json_and_pickle():
    r = Rollout(
        [_segment(), Segment()], reward=1.5, rollout_id="r1", group_id="g1", info={"turns": 2.0}
    )
    assert Rollout.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert pickle.loads(pickle.dumps(r)) == r
    g = Generation([1], [-0.5], "length", [3])
    assert Generation.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_misaligned_generation_is_refused():
    with pytest.raises(ValueError, match="misaligned"):
        Generation([1, 2], [-0.1], "stop", [0, 0])
    with pytest.raises(ValueError, match="routing"):
        Generation([1], [-0.1], "stop", [0], routed_experts=[])

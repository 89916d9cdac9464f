import dataclasses
import json
import pickle

import pytest

from molt_capture import Generation, Rollout, Segment


def _segment() -> Segment:
    seg = Segment(temperature=0.7)
    seg.append_context([1, 2, 3])
    # Rows from position 1: prompt positions 1 and 2, then the first sampled token (4).
    seg.append_generation(
        Generation([4, 5], [-0.1, -0.2], "stop", [7, 7], [[[1, 2]], [[3, 4]], [[5, 6]]], 1), 16
    )
    seg.append_context([6])
    return seg


def test_segment_alignment():
    seg = _segment()
    assert seg.token_ids == [1, 2, 3, 4, 5, 6]
    assert seg.trainable == [0, 0, 0, 1, 1, 0]
    assert seg.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0]
    assert seg.weight_versions == [-1, -1, -1, 7, 7, -1]
    # Position 0 was not reported, the last sampled token (5) and the context after it not run.
    assert seg.routed_experts == [None, [[1, 2]], [[3, 4]], [[5, 6]], None, None]
    assert seg.routing_known == 0
    assert seg.num_generated == 2 and seg.turns[0].start == 3 and seg.turns[0].end == 5


def test_rollout_round_trips_through_json_and_pickle():
    r = Rollout(
        [_segment(), Segment()], reward=1.5, rollout_id="r1", group_id="g1", info={"turns": 2.0}
    )
    assert Rollout.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert pickle.loads(pickle.dumps(r)) == r
    g = Generation([1], [-0.5], "length", [3])
    assert Generation(**json.loads(json.dumps(dataclasses.asdict(g)))) == g


def test_misaligned_generation_is_refused():
    with pytest.raises(ValueError, match="misaligned"):
        Generation([1, 2], [-0.1], "stop", [0, 0])
    with pytest.raises(ValueError, match="routing"):
        Generation([1, 2, 3], [-0.1] * 3, "stop", [0] * 3, routed_experts=[[[0]]])
    seg = Segment()
    seg.append_context([1, 2])
    with pytest.raises(ValueError, match="routing rows from position 0 for a 2-token prompt"):
        seg.append_generation(Generation([3], [-0.1], "stop", [0], routed_experts=[[[0]]]), 4)


def test_routing_rows_accumulate_across_turns():
    """Each request reports rows from where the segment's known rows end: the previous turn's
    last sampled token and the context after it come with the next turn's prefill."""
    seg = Segment()
    seg.append_context([1, 2])
    seg.append_generation(Generation([3, 4], [-0.1] * 2, "stop", [0] * 2, [[[0]], [[1]], [[2]]]), 4)
    assert seg.routed_experts == [[[0]], [[1]], [[2]], None] and seg.routing_known == 3
    seg.append_context([5])
    seg.append_generation(Generation([6], [-0.1], "stop", [1], [[[3]], [[4]]], 3), 4)
    assert seg.routed_experts == [[[0]], [[1]], [[2]], [[3]], [[4]], None]


def test_top_k_candidates_stay_aligned_across_turns():
    seg = Segment()
    seg.append_context([1, 2])
    seg.append_generation(Generation([3], [-0.1], "stop", [0]), 4)  # no candidates asked
    assert seg.top_ids is None
    gen = Generation([4, 5], [-0.2, -0.3], "stop", [1, 1], top_ids=[[4, 9], [5, 8]],
                     top_logprobs=[[-0.2, -2.0], [-0.3, -1.5]])  # fmt: skip
    seg.append_generation(gen, 4)
    seg.append_context([6])
    assert seg.top_ids == [[], [], [], [4, 9], [5, 8], []]
    assert seg.top_logprobs == [[], [], [], [-0.2, -2.0], [-0.3, -1.5], []]
    assert Segment.from_dict(json.loads(json.dumps(seg.to_dict()))) == seg
    with pytest.raises(ValueError, match="top-k rows"):
        Generation([1, 2], [-0.1] * 2, "stop", [0] * 2, top_ids=[[1]], top_logprobs=[[-0.1]])
    with pytest.raises(ValueError, match="come together"):
        Generation([1], [-0.1], "stop", [0], top_ids=[[1]])

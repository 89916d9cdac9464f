"""molt_examples.vlm_tool: the figures and their labels, the two tools, then one `molt-train`
run on the tiny VLM in which the model zooms and answers.

As in test_python_tool, the run's model is the tiny VLM taught first (plain supervised training
through Molt's own image encoder) to answer two rows with a `zoom` call, then the area. In the
run the engine sees the row's image, the Env crops it for the zoom, the crop comes back as an
image in the next user turn, and every token the trainer gets is checked against the engine's.
"""

import base64
import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image
from recorded import Recorded, metrics, molt_train, read_traces
from test_python_tool import chat_example, labels, teach

from molt_capture.render import ToolCall
from molt_examples import vlm_tool
from molt_examples.vlm_tool import calculate, draw, make_rows, tool_turn, zoom
from molt_rollout import EnvState

ZOOM = ToolCall("call_0", "zoom", {"box": [0, 0.5, 1, 1]})


def test_rows_alternate_shapes_and_label_the_area():
    rows = make_rows(4, seed=0)
    assert rows == make_rows(4, seed=0)  # seeded: the same file every time
    for i, row in enumerate(rows):
        (message,) = row["prompt"]
        assert message["content"][0] == {"type": "image"} and len(row["images"]) == 1
        shape = ("rectangle", "right triangle")[i % 2]
        assert f"area of the {shape}?" in message["content"][1]["text"]
        image = Image.open(io.BytesIO(base64.b64decode(row["images"][0])))
        assert image.size == (vlm_tool.SIZE, vlm_tool.SIZE)
    assert [row["label"] for row in rows] == ["120", "36", "50", "42"]  # 8x15, 8x9/2, ...


def test_a_triangle_with_an_odd_product_has_a_half_area():
    rng = random.Random(3)
    assert draw("triangle", 3, 5, rng)[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(row["label"].endswith(".5") for row in make_rows(40, seed=0))


def test_calculate_does_arithmetic_and_nothing_else():
    assert calculate("3 * 4 / 2") == "6"
    assert calculate("(2 + 3) ** 2 - -1") == "26"
    assert calculate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "x + 1", "9 ** 9 ** 9", "'a' * 3", "1 +"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1 / 0")


def test_zoom_enlarges_the_box_and_refuses_a_bad_one():
    image = Image.new("RGB", (200, 100), "white")
    part = Image.open(io.BytesIO(zoom(image, [0.5, 0.0, 0.75, 1.0])))
    assert part.size == (100, 200)  # 50 x 100 pixels, the longer side now the image's 200
    for box in ([0.5, 0.0, 0.5, 1.0], [0, 0, 2, 1], [0, 0, 1]):
        with pytest.raises(ValueError):
            zoom(image, box)


def test_tool_turn_answers_each_call_and_counts_the_mistakes():
    image = Image.new("RGB", (100, 100), "white")
    stats = {"tool_calls": 0.0, "zooms": 0.0, "tool_errors": 0.0}
    calls = [
        ZOOM,
        ToolCall("call_1", "calculate", {"expression": "8 * 15"}),
        ToolCall("call_2", "calculate", {"expr": "1"}),
        ToolCall("call_3", "ruler", {}),
    ]
    turn = tool_turn(image, calls, stats)
    assert turn["role"] == "user"
    texts = [part.get("text") for part in turn["content"]]
    assert texts == ["zoom:", None, "calculate: 120", "calculate error: 'expression'",
                     "ruler error: the tools are zoom and calculate"]  # fmt: skip
    assert turn["content"][1]["type"] == "image"
    assert stats == {"tool_calls": 4.0, "zooms": 1.0, "tool_errors": 2.0}


def test_the_env_scores_the_answer_and_answers_a_call():
    import asyncio

    from molt_capture.render import Reply

    row = make_rows(1, seed=0)[0]  # label 120

    async def steps():
        env = vlm_tool.GeometryEnv()
        state = EnvState(row=row, messages=[], tools=None, label=row["label"])
        await env.reset(state)
        state.reply, state.finish_reason = Reply(content="", tool_calls=[ZOOM]), "stop"
        first = await env.step(state)
        state.reply = Reply(content="The area is \\boxed{120}.")
        return first, await env.step(state)

    first, last = asyncio.run(steps())
    assert not first.terminated and first.observation[0]["content"][1]["type"] == "image"
    assert last.reward == last.score == 1.0 and last.terminated
    assert last.info == {"tool_calls": 1.0, "zooms": 1.0, "tool_errors": 0.0, "answered": 1.0}


class AgentRunner(Recorded, vlm_tool.AgentRunner):
    """The run's agent (this file): the example's runner, every engine call recorded."""

    def traced(self, row: dict) -> dict:
        return {"label": row["label"]}


def solved(row: dict) -> list[dict]:
    """The conversation taught for a row: zoom into the bottom half, then the area."""
    image = Image.open(io.BytesIO(base64.b64decode(row["images"][0]))).convert("RGB")
    stats = {"tool_calls": 0.0, "zooms": 0.0, "tool_errors": 0.0}
    call = {"type": "function", "function": {"name": ZOOM.name, "arguments": ZOOM.arguments}}
    (user,) = row["prompt"]
    return [
        {"role": "user", "content": [{"type": "image", "image": image}, user["content"][1]]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        tool_turn(image, [ZOOM], stats),
        {"role": "assistant", "content": f"The area is \\boxed{{{row['label']}}}."},
    ]


def vlm_inputs(tokenizer, encoder, messages: list[dict]) -> dict:
    """One conversation as the policy's forward takes it: ids with each image's placeholders
    expanded by Molt's image encoder, the images' pixels, the assistant turns as labels."""
    import numpy as np
    import torch

    from molt_capture.media import message_images

    sources, images = iter(message_images(messages)), []

    def encode(text: str) -> list[int]:
        taken = [next(sources) for _ in range(text.count(encoder.image_token))]
        if not taken:
            return tokenizer.encode(text, add_special_tokens=False)
        prompt = encoder.encode(text, taken)
        images.extend(prompt.images)
        return prompt.token_ids

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    ids, trained = chat_example(render, encode, messages)
    pixels = {name: np.concatenate([i.tensors[name] for i in images]) for name in images[0].tensors}
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels(ids, trained)]),
        **{name: torch.from_numpy(array)[None] for name, array in pixels.items()},
    }


@pytest.fixture(scope="module")
def taught_vlm(tmp_path_factory) -> tuple[str, list[dict]]:
    """The tiny VLM taught the zoom calls of two rows (a rectangle, a triangle); and the rows."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from molt_capture.media import load_image_encoder
    from molt_rollout.engines.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path_factory.mktemp("model") / "tiny-idefics3")
    tokenizer, encoder = AutoTokenizer.from_pretrained(str(path)), load_image_encoder(str(path))
    rows = make_rows(2, seed=0)
    batches = [vlm_inputs(tokenizer, encoder, solved(row)) for row in rows]
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    loss = teach(model, batches, steps=180)
    assert loss < 0.01, loss
    model.save_pretrained(str(path))  # over the random weights: the processor files stay
    return str(path), rows


@pytest.mark.slow
def test_molt_train_runs_the_vlm_tool_agent(tmp_path, taught_vlm):
    """Two on-policy steps: the row's image reaches the engine, the model's zoom call is run by
    the Env, the crop comes back as a masked image in the next turn, the reward is the
    example's score of the last reply, and every trained token is the engine's."""
    model, rows = taught_vlm
    data = tmp_path / "geometry_train.jsonl"
    data.write_text("".join(json.dumps(row | {"trace_dir": str(tmp_path)}) + "\n" for row in rows))
    run = tmp_path / "vlm_tool"
    molt_train(run, "--train.agent_path", __file__, "--actor.model_path", model,
               "--data.train_files", str(data), "--data.eval_files", str(data),
               "--train.num_steps", "2", "--rollout.groups_per_batch", "2",
               "--rollout.n_samples_per_prompt", "2", "--rollout.max_tokens", "48",
               "--rollout.num_runners", "1", "--rollout.seed", "0",
               "--train.force_on_policy", "True", "--vllm.dtype", "float32",
               "--eval.every_steps", "0", "--logger.wandb_mode", "disabled",
               "--ckpt.export_hf", "False")  # fmt: skip
    steps = metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
        assert 0.0 <= s["rollout/info/answered"] <= 1.0 and s["rollout/info/zooms"] >= 0.0
        assert "rollout/info/tool_calls" in s and "rollout/info/tool_errors" in s
    mismatch = [s["is/vllm_kl"] for s in steps if s["is/vllm_kl"] is not None]
    assert mismatch and max(abs(kl) for kl in mismatch) < 1e-3, mismatch  # pixels alike
    records = read_traces(tmp_path)
    assert len(records) >= 8  # 2 steps of 2 prompts x 2 samples
    for r in records:
        assert r["dropped"] is None and r["exact"] is True, r
        assert r["trained"] == r["generated"] and r["masked_between"] and r["images_masked"]
        assert r["reward"] == vlm_tool.score(r["replies"][-1], r["label"])[0]
    zoomed = [r for r in records if r["info"]["zooms"] >= 1]
    assert zoomed, [r["replies"] for r in records]  # the taught model zooms
    for r in zoomed:
        assert '"name": "zoom"' in r["replies"][0] and "zoom:" in r["between"][0]
        assert r["images"] == [1 + r["info"]["zooms"]]  # the row's image, then each crop


def test_the_example_data_is_written_where_asked(tmp_path):
    train = vlm_tool.write_data(tmp_path, train_rows=4, eval_rows=2)
    assert train == tmp_path / "geometry_train.jsonl"
    assert len(Path(tmp_path / "geometry_eval.jsonl").read_text().splitlines()) == 2

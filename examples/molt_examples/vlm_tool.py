"""A vision-language agent with tools, on geometry figures drawn here (no download): the image
shows a rectangle or a right triangle with its side lengths written beside the sides; the model
may `zoom` into the image (the enlarged part comes back as an image) and `calculate`, then
answers the area in \\boxed{}, scored as a number (python_tool.score).

The Env form: Molt generates each reply, `step` runs the reply's tool calls (parsed from the
model's <tool_call> markup as the capture server parses it) and returns their results as the
next user turn. A user turn, not a tool turn: images go in user turns in every chat template,
and some VLM templates have no tool turn at all. The tools are described in the prompt for the
same reason.

Write the data: python -m molt_examples.vlm_tool DIR (geometry_train.jsonl, geometry_eval.jsonl).
Run: --train.agent_path molt_examples.vlm_tool (docs/environments/vlm_tool.md).
"""

from __future__ import annotations

import ast
import base64
import io
import json
import operator
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from molt_capture.media import load_image
from molt_examples.python_tool import score
from molt_rollout import Env, EnvRunner, EnvState, Result

SIZE = 224  # pixels; the model's processor resizes as it does
QUESTION = "What is the area of the {shape}? Each side's length is written beside it."
TOOLS = (
    "Tools: zoom shows a part of the image enlarged, "
    '{"box": [left, top, right, bottom]} in fractions of the image from 0 to 1; '
    'calculate evaluates arithmetic, {"expression": "3 * 4 / 2"}. To use one, reply with '
    '<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0.5, 1, 1]}}\n</tool_call>\n'
    "Put the final answer in \\boxed{}."
)
MAX_TOOL_CALLS = 4  # per rollout; then the reply so far is scored


def draw(shape: str, a: int, b: int, rng: random.Random) -> bytes:
    """A PNG of a rectangle (a wide, b high) or a right triangle (legs a and b), lengths written
    beside the sides they measure."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen, font = ImageDraw.Draw(image), ImageFont.load_default(size=20)
    scale = 140 / max(a, b)
    width, height = round(a * scale), round(b * scale)
    left, top = rng.randint(40, SIZE - 16 - width), rng.randint(10, SIZE - 40 - height)
    right, bottom = left + width, top + height
    colour = tuple(rng.randint(0, 160) for _ in range(3))
    if shape == "rectangle":
        pen.rectangle((left, top, right, bottom), outline=colour, width=3)
    else:
        pen.polygon([(left, top), (left, bottom), (right, bottom)], outline=colour, width=3)
        pen.rectangle((left, bottom - 12, left + 12, bottom), outline=colour)  # the right angle
    pen.text(((left + right) / 2, bottom + 6), str(a), fill="black", font=font, anchor="mt")
    pen.text((left - 8, (top + bottom) / 2), str(b), fill="black", font=font, anchor="rm")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` rows as HF datasets store images: an `{"type": "image"}` part in the user turn,
    the PNG (base64) in the row's `images` column; the label is the area."""
    rng, rows = random.Random(seed), []
    for i in range(count):
        shape, a, b = ("rectangle", "triangle")[i % 2], rng.randint(2, 15), rng.randint(2, 15)
        area = a * b if shape == "rectangle" else a * b / 2
        text = QUESTION.format(shape="right triangle" if shape == "triangle" else shape)
        content = [{"type": "image"}, {"type": "text", "text": f"{text}\n{TOOLS}"}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": content}],
                "images": [base64.b64encode(draw(shape, a, b, rng)).decode()],
                "label": format(area, "g"),
                "data_source": "geometry",
            }
        )
    return rows


def write_data(directory: str | Path, train_rows: int = 512, eval_rows: int = 64) -> Path:
    """geometry_train.jsonl and geometry_eval.jsonl in `directory`; returns the train file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", make_rows(train_rows, 0)), ("eval", make_rows(eval_rows, 1))):
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (directory / f"geometry_{name}.jsonl").write_text(text)
    return directory / "geometry_train.jsonl"


def zoom(image: Image.Image, box: list) -> bytes:
    """The part of `image` inside `box` (fractions), enlarged to the image's size, as a PNG."""
    left, top, right, bottom = (float(v) for v in box)
    if not (0 <= left < right <= 1 and 0 <= top < bottom <= 1):
        raise ValueError("box must be [left, top, right, bottom] with 0 <= left < right <= 1")
    width, height = image.size
    part = image.crop((left * width, top * height, right * width, bottom * height))
    enlarge = max(width, height) / max(part.size)
    part = part.resize((round(part.width * enlarge), round(part.height * enlarge)))
    buffer = io.BytesIO()
    part.save(buffer, format="PNG")
    return buffer.getvalue()


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Arithmetic on numbers (+ - * / ** and brackets), nothing else: no names, no calls."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(left) > 1e6 or abs(right) > 64):
                raise ValueError("numbers too large for **")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return format(value(ast.parse(str(expression), mode="eval").body), ".12g")


def tool_turn(image: Image.Image, calls: list, stats: dict[str, float]) -> dict[str, Any]:
    """The user turn answering a reply's tool calls (each with `name` and `arguments`): text
    for each, and the enlarged image after a zoom. A call's mistake is the model's to read."""
    parts: list[dict[str, Any]] = []
    for call in calls:
        stats["tool_calls"] += 1
        try:
            if call.name == "zoom":
                crop = zoom(image, call.arguments["box"])
                parts += [{"type": "text", "text": "zoom:"}, {"type": "image", "image": crop}]
                stats["zooms"] += 1
            elif call.name == "calculate":
                result = calculate(call.arguments["expression"])
                parts.append({"type": "text", "text": f"calculate: {result}"})
            else:
                raise ValueError("the tools are zoom and calculate")
        except (KeyError, TypeError, ValueError, ArithmeticError, SyntaxError) as e:
            parts.append({"type": "text", "text": f"{call.name} error: {e}"})
            stats["tool_errors"] += 1
    return {"role": "user", "content": parts}


class GeometryEnv(Env):
    async def reset(self, state: EnvState) -> None:
        # The row's image (base64 in JSONL, bytes in datasets), decoded as Molt decodes it.
        self.image = load_image(state.row["images"][0]).convert("RGB")
        self.stats = {"tool_calls": 0.0, "zooms": 0.0, "tool_errors": 0.0}

    async def step(self, state: EnvState) -> Result:
        calls = state.reply.tool_calls
        more = self.stats["tool_calls"] < MAX_TOOL_CALLS and state.finish_reason == "stop"
        if calls and more:
            observation = [tool_turn(self.image, calls, self.stats)]
            return Result(reward=0.0, observation=observation, terminated=False)
        reward, answered = score(state.reply.content, state.label)
        info = self.stats | {"answered": float(answered)}
        return Result(reward=reward, score=reward, info=info, truncated=bool(calls))


class AgentRunner(EnvRunner):
    env_class = GeometryEnv


if __name__ == "__main__":  # python -m molt_examples.vlm_tool DIR
    import sys

    print(write_data(sys.argv[1] if len(sys.argv) > 1 else "."))

"""The shipped image task: name the colour drawn in a generated PNG, in the halves' answer.

Each prompt is the same text beside one image: a red or a blue disc on white, its size, place
and shade drawn at random. The label is the colour; the reply earns 1 when its first letter is
of the alphabet half that colour names ("red": a-m, "blue": n-z; `reward.py`'s rule). The text
never differs, so a policy blind to the image earns at most 0.5: reward above that means the
model reads the pixels. The tiny VLM (molt_rollout.engines.tiny_vlm) learns it on CPU like the text
quickstart (tests_integration/test_vlm.py); `colours_env` and `colours_chat` are its two forms.

Rows are written as the HF datasets image convention stores them: the user turn holds an
`{"type": "image"}` part and the row's `images` column the PNG, base64 in JSONL.
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

from molt_train.quickstart.reward import reward

QUESTION = "Which colour is the disc? Answer a-m for red, n-z for blue."
HALF = {"red": "a-m", "blue": "n-z"}


def colour_reward(reply: str, colour: str) -> float:
    return reward(reply, HALF[colour])


def draw(colour: str, rng: random.Random) -> bytes:
    """A PNG of a `colour` disc on white, 56x56 (the tower's processor resizes it)."""
    from PIL import Image, ImageDraw

    shade = rng.randint(160, 235)
    fill = (shade, rng.randint(0, 50), rng.randint(0, 50))
    if colour == "blue":
        fill = fill[::-1]
    image = Image.new("RGB", (56, 56), "white")
    r = rng.randint(18, 26)
    cx, cy = rng.randint(r, 56 - r), rng.randint(r, 56 - r)
    ImageDraw.Draw(image).ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` rows, half of each colour, in a seeded order."""
    rng = random.Random(seed)
    colours = [list(HALF)[i % len(HALF)] for i in range(count)]
    rng.shuffle(colours)
    return [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
            ],
            "images": [base64.b64encode(draw(colour, rng)).decode()],
            "label": colour,
            "data_source": "colours",
        }
        for colour in colours
    ]


def write_data(directory: str | Path, train_rows: int = 256, eval_rows: int = 32) -> Path:
    """colours_train.jsonl and colours_eval.jsonl in `directory`; returns the train file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", make_rows(train_rows, 0)), ("eval", make_rows(eval_rows, 1))):
        (directory / f"colours_{name}.jsonl").write_text(
            "".join(json.dumps(row) + "\n" for row in rows)
        )
    return directory / "colours_train.jsonl"


if __name__ == "__main__":  # python -m molt_train.quickstart.colours DIR
    import sys

    print(write_data(sys.argv[1] if len(sys.argv) > 1 else "."))

"""Writes the quickstart task's data next to this file: halves_train.jsonl, halves_eval.jsonl
(RL prompts) and halves_sft.jsonl (chat conversations for `molt-train sft`).

Run: python -m molt_train.quickstart.make_data   (deterministic: the same files every time)

A row shows one half of the alphabet, and its label names the half:
    {"prompt": [{"role": "user", "content": "abcdefghijklm"}], "label": "a-m", ...}
    {"prompt": [{"role": "user", "content": "nopqrstuvwxyz"}], "label": "n-z", ...}
with "data_source": "halves" (the eval metrics' name). The user turn is the half itself:
`reward.HALVES` maps each label to it.
Half the rows are of each label, in a seeded random order. The two prompts are fixed on
purpose: the whole half gives the model's last hidden state the most to tell them apart by
(benchmarks/quickstart_task_prototype.py).
"""

import json
import random
from pathlib import Path

from molt_train.quickstart.reward import HALVES

TRAIN_ROWS = 256
EVAL_ROWS = 50
SFT_ROWS = 128


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` rows, alternately of each label, shuffled with `seed`."""
    labels = [list(HALVES)[i % len(HALVES)] for i in range(count)]
    random.Random(seed).shuffle(labels)
    return [
        {
            "prompt": [{"role": "user", "content": HALVES[label]}],
            "label": label,
            "data_source": "halves",
        }
        for label in labels
    ]


def make_conversations(count: int, seed: int) -> list[dict]:
    """Chat rows for SFT: one or two exchanges, each answered with one letter of the half the
    prompt shows (lower or upper case)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        messages = []
        for _ in range(1 + i % 2):
            label = rng.choice(list(HALVES))
            answer = rng.choice(HALVES[label] + HALVES[label].upper())
            messages += [
                {"role": "user", "content": HALVES[label]},
                {"role": "assistant", "content": answer},
            ]
        rows.append({"messages": messages, "data_source": "halves"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    folder = Path(__file__).parent
    write_jsonl(folder / "halves_train.jsonl", make_rows(TRAIN_ROWS, seed=0))
    write_jsonl(folder / "halves_eval.jsonl", make_rows(EVAL_ROWS, seed=1))
    write_jsonl(folder / "halves_sft.jsonl", make_conversations(SFT_ROWS, seed=2))


if __name__ == "__main__":
    main()

"""Writes the quickstart task's data next to this file: digits_train.jsonl, digits_eval.jsonl
(RL prompts) and digits_sft.jsonl (chat conversations for `molt-train sft`).

Run: python -m molt_train.quickstart.make_data   (deterministic: the same files every time)

A row shows ten characters of one kind, and its label names the kind:
    {"prompt": [{"role": "user", "content": "0123456789"}], "label": "digit", ...}
    {"prompt": [{"role": "user", "content": "abcdefghij"}], "label": "letter", ...}
with "data_source": "digits" (the eval metrics' name).
Half the rows are of each kind, in a seeded random order. The two prompts are fixed on purpose:
benchmarks/quickstart_task_prototype.py measured shuffled digits and random letters, a system
turn, or the bare words "digit"/"letter" as slower and less stable from the random init.
"""

import json
import random
from pathlib import Path

PROMPTS = {"digit": "0123456789", "letter": "abcdefghij"}
TRAIN_ROWS = 256
EVAL_ROWS = 50
SFT_ROWS = 128


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` rows, alternately of each kind, shuffled with `seed`."""
    kinds = [list(PROMPTS)[i % len(PROMPTS)] for i in range(count)]
    random.Random(seed).shuffle(kinds)
    return [
        {
            "prompt": [{"role": "user", "content": PROMPTS[kind]}],
            "label": kind,
            "data_source": "digits",
        }
        for kind in kinds
    ]


def make_conversations(count: int, seed: int) -> list[dict]:
    """Chat rows for SFT: one or two exchanges, each answered with one character of the kind
    the prompt shows."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        messages = []
        for _ in range(1 + i % 2):
            kind = rng.choice(list(PROMPTS))
            answer = rng.choice("0123456789" if kind == "digit" else "abcdefghijklmnopqrstuvwxyz")
            messages += [{"role": "user", "content": PROMPTS[kind]},
                         {"role": "assistant", "content": answer}]  # fmt: skip
        rows.append({"messages": messages, "data_source": "digits"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    folder = Path(__file__).parent
    write_jsonl(folder / "digits_train.jsonl", make_rows(TRAIN_ROWS, seed=0))
    write_jsonl(folder / "digits_eval.jsonl", make_rows(EVAL_ROWS, seed=1))
    write_jsonl(folder / "digits_sft.jsonl", make_conversations(SFT_ROWS, seed=2))


if __name__ == "__main__":
    main()

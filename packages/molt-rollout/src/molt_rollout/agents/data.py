"""Prompt rows, loaded and checked, and the endless, mixed, resumable prompt stream. A row is a
dict: `prompt` (chat messages, or a string: one user turn), optional `tools`, `label` and
`data_source`, and other columns kept for the agent. See docs/concepts/rollout.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
# A file named after its split (`gsm8k/test.jsonl`) takes its directory's name as data source.
SPLIT_NAMES = ("train", "test", "validation", "val", "dev", "eval")
SAVED_DATASET_FILES = ("dataset_dict.json", "dataset_info.json", "state.json")


@dataclass
class DataConfig:
    """Where prompts come from and in what order (`--data.*`)."""

    train_files: list[str] = field(default_factory=list)  # files, saved datasets or hub ids
    # Mixing probabilities, one per train file (normalised). None: the files are concatenated
    # and every row is equally likely.
    train_weights: list[float] | None = None
    eval_files: list[str] = field(default_factory=list)  # eval prompts (--eval.every_steps)
    train_split: str = "train"  # the split read from saved DatasetDicts and hub ids
    eval_split: str = "test"  # the split read from saved DatasetDicts and hub ids for eval
    prompt_key: str = "prompt"  # the column holding the prompt (e.g. "question")
    label_key: str = "label"  # the column holding the label (e.g. "answer")
    # True: prompts are chat messages, and the chat template is applied exactly once (by the
    # Env runner before generating, by the capture server for a ChatAgent), so both agent forms
    # see identical prompt tokens. False: a string prompt is encoded verbatim (Env form only,
    # for base models).
    apply_chat_template: bool = True
    shuffle: bool = True  # a fresh seeded permutation of each dataset every epoch
    seed: int = 0  # the shuffle's seed
    max_prompts: int | None = None  # keep only the first rows of each train file (quick runs)


def validate_data_config(cfg: DataConfig) -> None:
    if not cfg.train_files:
        raise ValueError("--data.train_files is empty: give at least one file, directory or hub id")
    if cfg.train_weights is not None:
        if len(cfg.train_weights) != len(cfg.train_files):
            raise ValueError(
                f"--data.train_weights has {len(cfg.train_weights)} values for "
                f"{len(cfg.train_files)} --data.train_files: give one weight per file"
            )
        if any(w < 0 for w in cfg.train_weights) or sum(cfg.train_weights) <= 0:
            raise ValueError(
                f"--data.train_weights {cfg.train_weights}: weights must be >= 0 with a "
                "positive sum"
            )
    if cfg.max_prompts is not None and cfg.max_prompts < 1:
        raise ValueError(f"--data.max_prompts must be >= 1 or unset, got {cfg.max_prompts}")


# ---- loading one dataset ------------------------------------------------------------------


def load_rows(
    spec: str, split: str = "train", prompt_key: str = "prompt", label_key: str = "label"
) -> list[dict[str, Any]]:
    """Every row of a `.jsonl`/`.json`/`.parquet` file, a saved dataset (`split` of a
    DatasetDict), a directory of data files or a hub id, checked: a ValueError names the row."""
    path = Path(spec)
    name = _source_name(spec, path)
    rows = enumerate(_read(spec, path, split))
    return [_normalise(row, f"{spec}: row {i}", name, prompt_key, label_key) for i, row in rows]


def _read(spec: str, path: Path, split: str) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet") and not path.is_file():
        raise ValueError(f"data file {spec} does not exist")
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec} is not valid JSON ({e})") from e
        data = data.get("data") if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise ValueError(f"{spec}: expected a list of rows or {{'data': [rows]}}")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return _read_with_datasets(spec, path, split)


def _read_jsonl(path: Path) -> list[Any]:
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e})") from e
    return rows


def _read_with_datasets(spec: str, path: Path, split: str) -> list[Any]:
    # Imported here: only saved datasets and hub ids need it, and it is slow to import.
    import datasets

    if path.is_dir() and any((path / f).exists() for f in SAVED_DATASET_FILES):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{spec} has splits {sorted(data)}, not {split!r}")
            data = data[split]
        return data.to_list()
    try:  # a directory of data files, or a hub id
        return datasets.load_dataset(spec, split=split).to_list()
    except Exception as e:
        raise ValueError(
            f"could not load {spec!r} (split {split!r}): it is not a .jsonl, .json or .parquet "
            f"file or a saved dataset, and datasets.load_dataset failed: {type(e).__name__}: {e}"
        ) from e


def _source_name(spec: str, path: Path) -> str:
    """The default `data_source`: a file's stem (a split file's directory name), else the name."""
    if path.exists():
        path = path.resolve()
        if path.is_file():
            return path.parent.name if path.stem.lower() in SPLIT_NAMES else path.stem
        return path.name
    return spec


def _normalise(row: Any, where: str, name: str, prompt_key: str, label_key: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, not a dict")
    row = dict(row)
    if row.get(prompt_key) is None:
        raise ValueError(f"{where} has no prompt (column {prompt_key!r}; keys: {sorted(row)})")
    row["prompt"] = row[prompt_key]
    if label_key != "label":
        if label_key not in row:
            raise ValueError(f"{where} has no label column {label_key!r} (keys: {sorted(row)})")
        row["label"] = row[label_key]
    _check_prompt(row["prompt"], where)
    if isinstance(row.get("tools"), str):
        # Parquet and hub datasets usually store free-form JSON schemas as a JSON string.
        try:
            row["tools"] = json.loads(row["tools"])
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: tools is a string but not valid JSON ({e})") from e
    _check_tools(row.get("tools"), where)
    if row.get("data_source") is None:
        row["data_source"] = name
    return row


def _check_prompt(prompt: Any, where: str) -> None:
    if prompt == "":
        raise ValueError(f"{where}: the prompt is an empty string")
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: the prompt must be a string or a non-empty list of chat messages, got "
            f"{type(prompt).__name__} {prompt!r:.80}"
        )
    for j, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}: prompt message {j} must be a dict with 'role' and 'content', "
                f"got {message!r:.80}"
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}: prompt message {j} has role {message['role']!r}; use one of {ROLES}"
            )


def _check_tools(tools: Any, where: str) -> None:
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: tools must be a list of tool schemas, got {tools!r:.80}")
    for j, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"{where}: tool {j} must be {{'type': 'function', 'function': {{'name': ..., "
                f"'description': ..., 'parameters': ...}}}}, got {tool!r:.80}"
            )


def load_datasets(
    files: list[str], split: str, cfg: DataConfig, max_rows: int | None = None
) -> list[list[dict[str, Any]]]:
    """Each file's first `max_rows` rows; string prompts only without the chat template."""
    out = []
    for spec in files:
        rows = load_rows(spec, split, cfg.prompt_key, cfg.label_key)[:max_rows]
        if not rows:
            raise ValueError(f"{spec} has no rows")
        chats = [i for i, row in enumerate(rows) if not isinstance(row["prompt"], str)]
        if chats and not cfg.apply_chat_template:
            raise ValueError(
                f"{spec}: row {chats[0]} has chat messages as prompt but "
                "--data.apply_chat_template is off: give string prompts or turn it on"
            )
        out.append(rows)
    return out


def load_eval_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    return [row for rows in load_datasets(cfg.eval_files, cfg.eval_split, cfg) for row in rows]


# ---- the prompt stream --------------------------------------------------------------------


class PromptSource:
    """An endless stream of `(prompt_index, row)`. Each dataset is read in a permutation of
    (seed, dataset, epoch) when `shuffle`, so the state is a few counters. With `weights` (one
    per dataset), each draw picks a dataset, each wrapping into its next epoch on its own;
    without, the datasets are concatenated. Rows are handed out as stored: do not mutate them."""

    def __init__(
        self,
        datasets: list[list[dict[str, Any]]],
        weights: list[float] | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if weights is None:
            datasets = [[row for rows in datasets for row in rows]]
        self.probs = None if weights is None else np.asarray(weights, dtype=float) / sum(weights)
        self.datasets = datasets
        self.shuffle, self.seed = shuffle, seed
        self._rng = np.random.default_rng(seed)  # which dataset each draw takes from
        self._index, self._cursors, self._epochs = 0, [0] * len(datasets), [0] * len(datasets)
        self._orders = [self._order(d) for d in range(len(datasets))]

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PromptSource:
        validate_data_config(cfg)
        datasets = load_datasets(cfg.train_files, cfg.train_split, cfg, cfg.max_prompts)
        return cls(datasets, cfg.train_weights, cfg.shuffle, cfg.seed)

    @property
    def epoch(self) -> int:
        """Completed passes over the first (without weights: the only) dataset."""
        return self._epochs[0]

    def _order(self, d: int) -> np.ndarray:
        n = len(self.datasets[d])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, d, self._epochs[d]]).permutation(n)

    def next(self) -> tuple[int, dict[str, Any]]:
        d = 0 if self.probs is None else int(self._rng.choice(len(self.probs), p=self.probs))
        if self._cursors[d] == len(self.datasets[d]):
            self._cursors[d] = 0
            self._epochs[d] += 1
            self._orders[d] = self._order(d)
        row = self.datasets[d][self._orders[d][self._cursors[d]]]
        self._cursors[d] += 1
        self._index += 1
        return self._index - 1, row

    def state_dict(self) -> dict[str, Any]:
        return {
            "index": self._index,
            "cursors": list(self._cursors),
            "epochs": list(self._epochs),
            "rng": self._rng.bit_generator.state,
            "sizes": [len(rows) for rows in self.datasets],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sizes = [len(rows) for rows in self.datasets]
        if state["sizes"] != sizes:
            raise ValueError(
                f"the prompt data changed since this state was saved: dataset sizes "
                f"{state['sizes']} then, {sizes} now"
            )
        self._index = state["index"]
        self._cursors, self._epochs = list(state["cursors"]), list(state["epochs"])
        self._rng.bit_generator.state = state["rng"]
        self._orders = [self._order(d) for d in range(len(self.datasets))]

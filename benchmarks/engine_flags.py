"""What each of Molt's vLLM server flags costs a plain engine, one flag at a time.

    python benchmarks/gpu_rollout.py --write /tmp/q3r          # the model and prompts
    python benchmarks/engine_flags.py --model /tmp/q3r --out $OUT

Starts vLLM's OpenAI server over and over on the same GPU: bare (the flags `gpu_rollout.py`'s
bare side passes), all of Molt's flags at once, bare again, then bare plus each group of the
flags Molt adds (`molt_rollout.config.server_args`, the function the engines are started with,
grouped by flag name, and Molt's server environment as one more group). Each
server answers the same prompts x samples, all at once, to `/v1/completions` without log-probs
(aiohttp, as the runners' client). Prints generated tokens/s per variant and its ratio to the
mean of the two bare runs; their spread is the noise floor.

H200 run5 found an engine with Molt's flags at 0.64x a bare one of the call before (27.3K
against 42.7K tokens/s; docs/benchmarks.md): this splits that in one call.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

from gpu_rollout import BARE_FLAGS, MAX_LEN, MEMORY, bare

MOLT_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # what EngineServer adds to the server's environment
OWN = {"--model", "--host", "--port"}  # where the server listens: each run picks its own


def molt_groups(model: Path, backend: str) -> dict[str, list[str]]:
    """Molt's server flags that the bare server lacks, grouped by flag name."""
    from molt_rollout.config import VLLMConfig, server_args

    cfg = VLLMConfig(dtype="bfloat16", gpu_memory_utilization=float(MEMORY),
                     max_model_len=int(MAX_LEN))  # fmt: skip
    args = server_args(cfg, str(model), 0, backend)
    groups: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        flag, j = args[i], i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        pair = args[i:j]
        if flag not in OWN and not _in(pair, BARE_FLAGS):
            groups.setdefault(flag, []).extend(pair)
        i = j
    return groups


def _in(pair: list[str], args: list[str]) -> bool:
    return any(args[k : k + len(pair)] == pair for k in range(len(args)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--backend", default="molt_ipc", help="the weight-transfer backend Molt names")
    p.add_argument("--part", choices=("all", "total", "groups"), default="all",
                   help="total: bare, all of Molt's, bare again; groups: bare, then each "
                        "group")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/engine_flags")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    groups = molt_groups(args.model, args.backend)
    every = [a for g in groups.values() for a in g]
    # The total and the noise floor first, then one group at a time: a run cut short still
    # answers whether Molt's flags cost anything.
    total = [("molt (all)", every, MOLT_ENV), ("bare again", [], {})]
    each = [*((f"+{k}", v, {}) for k, v in groups.items()), ("+env", [], MOLT_ENV)]
    variants = [("bare", [], {}), *(total if args.part != "groups" else []),
                *(each if args.part != "total" else [])]  # fmt: skip
    rates = {}
    for name, extra, env in variants:
        slug = name.strip("+ ").replace(" ", "_").replace("(", "").replace(")", "").lstrip("-")
        rates[name] = bare(args.model, args.samples, args.max_tokens, args.out, extra, env, slug,
                           logprobs=False)["tokens_per_s"]  # fmt: skip
        floor = statistics.mean(rates.get(k, rates["bare"]) for k in ("bare", "bare again"))
        print(f"{name:32s} {rates[name]:10.0f} tokens/s {rates[name] / floor:5.2f}x bare  "
              f"{' '.join(extra)}", flush=True)  # fmt: skip
        record = {"groups": groups, "tokens_per_s": rates}
        (args.out / f"engine_flags_{args.part}.json").write_text(json.dumps(record, indent=2))
    print(f"\nbare: {rates['bare']:.0f} and {rates.get('bare again', 0):.0f} tokens/s (the floor)")
    for name, rate in rates.items():
        print(f"{name:32s} {rate / floor:5.2f}x bare")


if __name__ == "__main__":
    main()

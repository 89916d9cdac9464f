"""The quickstart's trainer side alone: one step's old-log-prob pass and optimizer step on a
batch shaped like the quickstart's (128 sequences of 23 tokens, one trained token each), on the
embedded tiny model, without engines.

    python benchmarks/quickstart_trainer_profile.py [--workers 0|1|2] [--threads 2]
        [--layout packed|padded] [--profile]

--workers 0 runs ModelWorker in this process (a world of one over gloo, no Ray); 1 or 2 run
the ModelGroup over Ray actors, as the loop does. Prints the medians over --steps steps (the
first is dropped) of the separate old-log-prob forward and of train_step, each as the loop
calls it; --profile adds torch.profiler's top operators of one in-process step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from molt_rollout.tiny_model import build_tiny_model
from molt_train.actor_config import ActorConfig, FSDPConfig, OptimConfig
from molt_train.cli import QUICKSTART, parse
from molt_train.config import resolved
from molt_train.packing import Sample


def quickstart_batch(generator: torch.Generator) -> list[Sample]:
    samples = []
    for i in range(128):
        ids = torch.randint(0, 390, (23,), generator=generator).tolist()
        samples.append(Sample(token_ids=ids, loss_mask=[0] * 22 + [1],
                              advantages=[0.0] * 22 + [float(i % 3 - 1)],
                              weights=[0.0] * 22 + [1.0]))  # fmt: skip
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=0, help="0: in process, no Ray")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (in process)")
    parser.add_argument("--layout", choices=("packed", "padded"), default="padded")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = str(build_tiny_model())
    algo = resolved(parse(QUICKSTART)).algo
    actor = ActorConfig(model_path=model, num_workers=max(args.workers, 1),
                        optim=OptimConfig(lr=5e-3))  # fmt: skip
    if args.workers:
        import ray

        from molt_train.model_group import ModelGroup

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        group = ModelGroup(actor, FSDPConfig(), on_gpu=False)
        if args.layout == "packed":
            raise SystemExit("--layout packed: in process only (--workers 0)")

        def forward(samples):
            return group.forward_logprobs(samples)

        def train(samples):
            group.train_step(samples, algo)
    else:
        from molt_train.model_worker import ModelWorker

        torch.set_num_threads(args.threads)
        worker = ModelWorker(actor, FSDPConfig(), "policy", 0, 1, on_gpu=False)
        worker.setup(model, "127.0.0.1", 29533)
        worker.padded = args.layout == "padded"

        def forward(samples):
            return worker.forward_logprobs([samples])[0]

        def train(samples):
            worker.train_step([samples], 128, 128, algo)

    generator = torch.Generator().manual_seed(0)
    forward_s, train_s = [], []
    for _ in range(args.steps):
        samples = quickstart_batch(generator)
        t0 = time.perf_counter()
        for sample, old in zip(samples, forward(samples), strict=True):
            sample.old_logprobs = old
        t1 = time.perf_counter()
        train(samples)
        forward_s.append(t1 - t0)
        train_s.append(time.perf_counter() - t1)
    where = (
        f"{args.workers} Ray worker(s)" if args.workers else f"in process, {args.threads} threads"
    )
    print(f"{where}, {args.layout} rows: old-log-prob forward median "
          f"{statistics.median(forward_s[1:]):.4f} s, train_step median "
          f"{statistics.median(train_s[1:]):.4f} s")  # fmt: skip
    if args.profile and not args.workers:
        from torch.profiler import ProfilerActivity, profile

        samples = quickstart_batch(generator)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for sample, old in zip(samples, forward(samples), strict=True):
                sample.old_logprobs = old
            train(samples)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

"""Where `molt-train quickstart`'s start-up goes: wall time from process start to each phase.

    RAY_AUTH_MODE=disabled python benchmarks/quickstart_startup.py [-- extra molt-train flags]

Runs the quickstart for 2 steps in this process with each start-up phase wrapped to print its
start and end, in seconds since the interpreter started (docs/benchmarks.md, issue 13). The
engine's own phases (imports, engine-core start, compile) are in its log, which the run
directory keeps.
"""

import functools
import sys
import time

T0 = time.time()


def stamp(what: str) -> None:
    now = time.time()  # the clock time too: the engine's log stamps its lines with it
    print(f"[startup] {now - T0:7.1f} s  {time.strftime('%H:%M:%S', time.localtime(now))}  {what}",
          flush=True)  # fmt: skip


def traced(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        stamp(f"{label} begins")
        try:
            return original(*args, **kwargs)
        finally:
            stamp(f"{label} ends")

    setattr(owner, name, wrapper)


def main() -> None:
    import ray

    stamp("ray imported")
    from molt_train import cli, loop

    stamp("molt_train imported")
    traced(ray, "init", "ray.init")
    traced(loop.RolloutService, "start", "engines and router")
    traced(loop.ModelGroup, "__init__", "model group")
    traced(loop.RunnerActors, "__init__", "agent runners created")
    traced(loop.RunnerActors, "connect", "agent runners connect")
    traced(loop.ModelGroup, "init_refit", "refit link")
    traced(loop, "train_on", "a training step")
    extra = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    cli.main(["quickstart", "--train.num_steps", "2", "--eval.every_steps", "0",
              "--logger.wandb_mode", "disabled", "--ckpt.export_hf", "False", *extra])  # fmt: skip
    stamp("run done")


if __name__ == "__main__":
    main()

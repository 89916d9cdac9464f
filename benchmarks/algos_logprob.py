"""Chunked vs naive per-token log-probabilities and entropy: time and peak memory.

    python benchmarks/algos_logprob.py                  # cuda when present, else cpu
    python benchmarks/algos_logprob.py --device cpu --tokens 8192 --vocab 151936 --hidden 2048
    python benchmarks/algos_logprob.py --chunk-size 1024 2048 --no-entropy

Both variants compute, for T tokens, log π(y_t) and the entropy of softmax(h_t Wᵀ / τ) with
W [V, H], from bf16 hidden states and weight by default. `naive` materialises the [T, V] logits
and upcasts them to float32 as one tensor, then log_softmax, gather and -Σ p log p over the whole
batch; `chunked` is molt_algos.logprobs.token_logprobs_and_entropy, once per --chunk-size given
(on CUDA its per-block work runs compiled: the first call, which is not timed, compiles).
Two modes: `forward` (no autograd, as for old-policy or reference log-probs) and
`forward+backward` (the gradient of Σ (lp + H) reaches both the hidden states and the LM-head
weight, as in a policy-loss step with an entropy term). --no-entropy leaves the entropy out of
both variants.

Every (variant, mode, chunk size) runs in a fresh subprocess so that one cannot inherit the
other's memory. Peak memory is what the call needs beyond its inputs (hidden, weight, targets);
the gradients of hidden and weight, which both variants return, count towards it. On CPU it is
the process's peak resident set (VmHWM, reset through /proc/self/clear_refs just before the first
call) minus the resident set before it; on CUDA it is torch.cuda.max_memory_allocated minus the
memory allocated before it. Memory is read on the first call; time is the median of the calls
after it (--repeats).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ["naive", "chunked"]
MODES = ["forward", "forward+backward"]
GIB = 2**30


def naive(hidden, weight, targets, temperature, compute_entropy):
    """The whole [T, V] logits in float32, written as a one-pass script would."""
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    logprobs = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return logprobs, entropy


def resident_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, from /proc (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_resident() -> None:
    # Writing 5 resets VmHWM to the current resident set (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def worker(args) -> dict:
    """One (variant, mode) in this process: returns its peak extra memory and median time."""
    from molt_algos.logprobs import token_logprobs_and_entropy

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=generator)
    # 1/sqrt(H) keeps the logits O(1), as in a trained head.
    weight = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype, generator=generator)
    weight /= args.hidden**0.5
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)
    backward = args.mode == "forward+backward"
    hidden.requires_grad_(backward)
    weight.requires_grad_(backward)

    def call():
        if args.variant == "naive":
            return naive(hidden, weight, targets, args.temperature, not args.no_entropy)
        return token_logprobs_and_entropy(
            hidden, weight, targets, args.temperature, args.chunk_size[0], not args.no_entropy
        )

    def step():
        hidden.grad = weight.grad = None
        with torch.set_grad_enabled(backward):
            logprobs, entropy = call()
            if backward:
                (logprobs.sum() + (0 if entropy is None else entropy.sum())).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        before = resident_bytes("VmRSS")
        reset_peak_resident()
        step()
        peak = resident_bytes("VmHWM") - before

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": peak, "seconds": statistics.median(times)}


def run_case(args, variant: str, mode: str, chunk_size: int = 0) -> dict:
    command = [sys.executable, __file__, "--worker", f"--variant={variant}", f"--mode={mode}"]
    command.append(f"--chunk-size={chunk_size}")
    for name in ["device", "dtype", "tokens", "vocab", "hidden", "temperature"]:
        command.append(f"--{name}={getattr(args, name)}")
    command.append(f"--repeats={args.repeats}")
    if args.no_entropy:
        command.append("--no-entropy")
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{variant} {mode} failed:\n{finished.stderr}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="of hidden states and weight")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--chunk-size", type=int, nargs="+", default=[1024])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-entropy", action="store_true", help="log-probs alone")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls after the first")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.device == "cuda" else 2

    if args.worker:
        print(json.dumps(worker(args)))
        return

    print(
        f"{machine(args.device)}; T={args.tokens}, V={args.vocab}, H={args.hidden}, "
        f"{args.dtype}, temperature={args.temperature}, "
        f"{'log-probs only' if args.no_entropy else 'log-probs and entropy'}; "
        f"time = median of {args.repeats} calls after the first\n"
    )
    print(
        "| mode | chunk_size | naive time (s) | chunked time (s) | time chunked/naive "
        "| naive peak (GiB) | chunked peak (GiB) | memory chunked/naive |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in args.modes:
        naive_result = run_case(args, "naive", mode)
        for chunk_size in args.chunk_size:
            chunked_result = run_case(args, "chunked", mode, chunk_size)
            print(
                f"| {mode} | {chunk_size} | {naive_result['seconds']:.3f} "
                f"| {chunked_result['seconds']:.3f} "
                f"| {chunked_result['seconds'] / naive_result['seconds']:.2f} "
                f"| {naive_result['peak_bytes'] / GIB:.2f} "
                f"| {chunked_result['peak_bytes'] / GIB:.2f} "
                f"| {chunked_result['peak_bytes'] / naive_result['peak_bytes']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

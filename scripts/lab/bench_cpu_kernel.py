"""Side by side in one process: torch's few-row products (F.linear, or weight-first, as the
backend used them before the kernel) vs the native kernel (csrc/cpu_kernels), per SmolLM2 layer
shape and over whole verification steps (`cost_curve.step_times`, context 512). `--previous`
adds another build of the kernel module (e.g. one built from an earlier commit) to both.

    python scripts/lab/bench_cpu_kernel.py [--rounds 3] [--previous path/to/_cpu_kernels.so]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from agentaccel.backends.local import cpu_matmul, load_model
from agentaccel.backends.local.cost_curve import step_times

SHAPES = {"q/o 576x576": (576, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536),
          "head 49152x576": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 33)
STEP_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _load_build(path: Path):
    """Another build of the kernel module, loaded beside the installed one."""
    spec = importlib.util.spec_from_file_location("_cpu_kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ways(kernels: dict, x: torch.Tensor, n: int) -> dict:
    rows, k = x.shape
    y = torch.empty(rows, n)
    if rows == 1 or rows > cpu_matmul.BODY_ROWS[1]:
        def torch_path(w):
            return F.linear(x, w)
    else:
        def torch_path(w):
            return (w @ x.t()).t().contiguous()

    def kernel_path(module):
        return lambda w: module.linear_into(x.data_ptr(), rows, k, w.data_ptr(), n, y.data_ptr())

    return {"torch": torch_path} | {name: kernel_path(module) for name, module in kernels.items()}


def per_layer(kernels: dict) -> None:
    for name, (n, k) in SHAPES.items():
        copies = 30 if n < 10_000 else 2  # more weight than the caches hold: read from memory, as in a step
        weights = [torch.randn(n, k) for _ in range(copies)]
        for rows in ROWS:
            ways = _ways(kernels, torch.randn(rows, k), n)
            best: dict[str, float] = {}
            for _ in range(5):
                for way, run in ways.items():  # alternating: a slow phase of the machine hits all
                    t0 = time.perf_counter()
                    for w in weights:
                        run(w)
                    best[way] = min(best.get(way, 1e9), (time.perf_counter() - t0) / copies * 1e6)
            print(f"{name:17s} rows {rows:2d}  " + "  ".join(f"{way} {us:8.1f} us" for way, us in best.items())
                  + f"  x{best['torch'] / best['kernel']:.2f}  kernel {n * k * 4 / best['kernel'] / 1e3:5.1f} GB/s")


def whole_steps(rounds: int, kernels: dict) -> None:
    model, _ = load_model()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    forwards = {"kernel": [m.forward for m in linears]}
    for name, module in kernels.items():
        if name != "kernel":  # the installed build is already routed by load_model
            forwards[name] = [types.MethodType(cpu_matmul._kernel_forward(module.linear_into), m) for m in linears]
    cpu_matmul.route_small_batches(model, use_kernel=False)
    forwards["torch"] = [m.forward for m in linears]
    samples: dict[str, list[dict[int, float]]] = {way: [] for way in forwards}
    for _ in range(rounds):
        for way in samples:
            for m, f in zip(linears, forwards[way], strict=True):
                m.forward = f
            samples[way].append(step_times(model, context=512, sizes=STEP_SIZES, repeats=5))
    for way, runs in samples.items():
        ms = {d: statistics.median(r[d] for r in runs) for d in STEP_SIZES}
        print(f"{way:6s} step ms  " + "  ".join(f"{d}:{ms[d]:.1f}" for d in STEP_SIZES))
        print(f"{way:6s} relative " + "  ".join(f"{d}:{ms[d] / ms[0]:.2f}" for d in STEP_SIZES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of whole-step timings")
    parser.add_argument("--previous", type=Path, help="another build of the kernel module to compare (a .so file)")
    args = parser.parse_args()
    if cpu_matmul._kernels() is None:
        raise SystemExit("the native kernel is not available on this CPU (needs x86 with AVX2 and FMA)")
    kernels = {"kernel": cpu_matmul._kernels()}
    if args.previous:
        kernels["previous"] = _load_build(args.previous)
    per_layer(kernels)
    whole_steps(args.rounds, kernels)


if __name__ == "__main__":
    main()

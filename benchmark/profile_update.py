"""Where the CPU time of an update goes, and how close to the arithmetic limit the scripts run: for each script, on
benchmark/speed.py's workload (Hopper-v4, batch 256, 1000 random steps, then one update per env step), with
--torch-threads 1 unless told otherwise,

- the FLOPs of one env step once learning has started (its updates and the actor's forward for acting), counted by
  torch.utils.flop_counter on a short run;
- its steps/s without the profiler, and so the GFLOP/s it achieves, beside the core's own FP32 peak measured on a
  large matrix product with the same threads;
- a per-op profile (torch.profiler, self CPU time per env step) of a run, grouped: matrix products, the optimizer
  step, the other ops, and the rest of the step without the profiler: the time outside torch's ops (Python, the
  env, numpy). The profiler adds its own overhead to every op, so the ops' times are upper bounds and the rest a
  lower bound.

    python benchmark/profile_update.py --scripts td3_continuous.py sac_continuous.py td7_continuous.py --updates 1000

Each script runs in a process of its own; the markdown goes to stdout and is appended to --out when given.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmark.speed import load_script, workload_flags  # noqa: E402

GROUPS = {  # the ops' name prefixes of each group; the rest are "other ops"
    "matrix products": ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"),
    "optimizer step": ("aten::_fused_adam", "Optimizer."),  # the fused kernel, and the step's and zero_grad's Python
}


def peak_gflops(size=2048, repeats=10):
    """The FP32 GFLOP/s of a large matrix product with torch's current threads: the core's practical peak."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def run_script(script, updates, threads, wrap):
    """Run the workload of `script` in this process, inside the context manager `wrap`; returns seconds taken."""
    import tyro

    module = load_script(script)
    args = tyro.cli(module.Args, args=workload_flags(script, "cpu", updates, threads))
    start = time.perf_counter()
    with wrap:
        module.main(args)
    return time.perf_counter() - start


def child(script, updates, threads, flop_updates, base_updates=10):
    """One script's measurements, as one JSON line. Each is the difference between a run of `updates` and one of
    `base_updates`, so that setup, the random phase and the final evaluation drop out."""
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    run_script(script, flop_updates, threads, counter)
    measured = {}
    for n in (base_updates, updates):
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        plain = run_script(script, n, threads, contextlib.nullcontext())
        profiled = run_script(script, n, threads, profiler)
        measured[n] = plain, profiled, {e.key: e.self_cpu_time_total / 1e6 for e in profiler.key_averages()}
    (plain0, profiled0, ops0), (plain1, profiled1, ops1) = measured[base_updates], measured[updates]
    steps = updates - base_updates
    print(
        json.dumps(
            {
                "flops_per_step": counter.get_total_flops() / flop_updates,
                "seconds_per_step": (plain1 - plain0) / steps,
                "profiled_seconds_per_step": (profiled1 - profiled0) / steps,
                "ops": {name: (seconds - ops0.get(name, 0.0)) / steps for name, seconds in ops1.items()},
                "peak_gflops": peak_gflops(),
            }
        )
    )


def report(script, m, top):
    """A script's measurements as markdown, per env step of the learning phase (an update and the acting step)."""
    achieved = m["flops_per_step"] / m["seconds_per_step"] / 1e9
    ops = sorted(m["ops"].items(), key=lambda item: -item[1])
    in_ops = sum(seconds for _, seconds in ops)
    groups = {name: 0.0 for name in [*GROUPS, "other ops"]}
    for name, seconds in ops:
        group = next((g for g, prefixes in GROUPS.items() if name.startswith(prefixes)), "other ops")
        groups[group] += seconds
    total = m["seconds_per_step"]  # the shares are of the step without the profiler, whose overhead is outside ops
    lines = [
        f"### {script}",
        "",
        f"- FLOPs per env step once learning has started: {m['flops_per_step'] / 1e6:.0f} MFLOP",
        f"- Without the profiler: {1e3 * m['seconds_per_step']:.2f} ms per step ({1 / m['seconds_per_step']:.0f} "
        f"steps/s), {achieved:.1f} GFLOP/s, against the core's {m['peak_gflops']:.0f} GFLOP/s on a 2048x2048 "
        f"matrix product: {achieved / m['peak_gflops']:.0%} of the limit",
        f"- Profiled: {1e3 * m['profiled_seconds_per_step']:.2f} ms per step, of which in torch's ops "
        f"{1e3 * in_ops:.2f} ms; the shares below are of the step without the profiler",
        "",
        "| where | ms per step | share of the step |",
        "|---|---|---|",
        *[f"| {name} | {1e3 * s:.2f} | {s / total:.0%} |" for name, s in groups.items()],
        f"| outside torch's ops (Python, the env, numpy): the rest | {1e3 * max(total - in_ops, 0):.2f} | "
        f"{max(total - in_ops, 0) / total:.0%} |",
        "",
        f"Top {top} ops by self CPU time:",
        "",
        "| op | ms per step | share |",
        "|---|---|---|",
        *[f"| `{name}` | {1e3 * s:.3f} | {s / total:.1%} |" for name, s in ops[:top]],
        "",
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=["td3_continuous.py", "sac_continuous.py", "td7_continuous.py"])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--flop-updates", type=int, default=100, help="the short run that counts FLOPs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", help="a markdown file to append to")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)  # for the peak, as --torch-threads sets it for the runs
        return child(args.child, args.updates, args.threads, args.flop_updates)
    text = f"\n## Profile: {args.updates} updates, --torch-threads {args.threads}\n\n"
    for script in args.scripts:
        command = [sys.executable, __file__, "--child", script, "--updates", str(args.updates)]
        command += ["--threads", str(args.threads), "--flop-updates", str(args.flop_updates)]
        out = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.mkdtemp())
        if out.returncode:
            sys.exit(f"{script} failed:\n{out.stderr[-3000:]}")
        section = report(script, json.loads(out.stdout.strip().splitlines()[-1]), args.top)
        print(section, flush=True)
        text += section
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

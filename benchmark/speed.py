"""Speed and memory of the algorithm scripts on one fixed workload, written as a markdown table.

Workload: Hopper-v4 (CartPole-v1 for sac_discrete.py), 1 env, batch 256, default networks, --learning-starts
1000 random steps, then --updates env steps with the script's updates (one per env step), no periodic
evaluation. ERL: its default population of 10 and one learner on Hopper-v4; it runs whole generations, so it
may take a few more steps; its steps/s counts population, learner and update time alike. Steps/s is the script's own
charts/SPS: env steps per second counted from the first gradient update, read from its TensorBoard log.
Steps/s "steady" counts only the second half of the updates: it leaves out --compile's compilation and a CUDA
graph's capture. Peak memory is the process's maximum resident set (CPU) and torch's peak allocation (CUDA).
--modes runs the updates eagerly (the default), with --compile, --cudagraphs or both (compile+cudagraphs).

    python benchmark/speed.py                       # every script, CPU, and CUDA when present
    python benchmark/speed.py --scripts td3_continuous.py --devices cpu --updates 3000
    python benchmark/speed.py --threads 1 --together 2       # two runs side by side, one thread each
    python benchmark/speed.py --devices cuda --modes eager compile cudagraphs compile+cudagraphs
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD_ENV = {
    "td3_continuous.py": "Hopper-v4",
    "td7_continuous.py": "Hopper-v4",
    "sac_continuous.py": "Hopper-v4",
    "sac_discrete.py": "CartPole-v1",
    "erl_td3.py": "Hopper-v4",
}


MODE_FLAGS = {
    "eager": [],
    "compile": ["--compile"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}


def steady_sps(points, start):
    """Steps/s over the second half of the updates, from charts/SPS's (step, mean steps/s since `start`) points: each
    point gives the seconds since `start`; the rate between the point nearest the middle and the last."""
    seconds = [(step, (step - start) / sps) for step, sps in points if sps > 0]
    end_step, end_time = seconds[-1]
    mid_step, mid_time = min(seconds, key=lambda point: abs(point[0] - (start + end_step) / 2))
    return (end_step - mid_step) / (end_time - mid_time) if end_time > mid_time else float("nan")


def workload_flags(script, device, updates, threads=None, mode="eager"):
    """The workload's command line for `script` (a name with or without .py). tests/test_gpu.py runs its GPU checks
    with these shapes (env, batch, buffer, networks), so that a device check compiles each update once for both."""
    script = Path(script).stem + ".py"
    flags = ["--env-id", WORKLOAD_ENV[script], "--batch-size", "256", "--learning-starts", "1000"]
    flags += ["--total-timesteps", str(1000 + updates), "--eval-freq", "0", "--eval-episodes", "1"]
    flags += ["--checkpoint-freq", "0", "--cuda" if device == "cuda" else "--no-cuda"]
    flags += [] if threads is None else ["--torch-threads", str(threads)]
    flags += [] if script == "erl_td3.py" else ["--log-freq", "100"]  # ERL logs once per generation
    return flags + MODE_FLAGS[mode]


def load_script(script):
    """Import an algorithm script from the repository as a module of its own name (torch.compile looks it up)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(script, device, updates, threads, mode="eager"):
    """Run the workload in this process; print one JSON line with the measurements."""
    import torch
    import tyro
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module = load_script(script)
    flags = workload_flags(script, device, updates, threads, mode)
    summary = module.main(tyro.cli(module.Args, args=flags))
    events = EventAccumulator(summary["run_dir"], size_guidance={"scalars": 0})
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("charts/SPS")]
    print(
        json.dumps(
            {
                "sps": points[-1][1],
                "steady_sps": steady_sps(points, 1000),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(WORKLOAD_ENV))
    parser.add_argument("--devices", nargs="+", help="cpu and/or cuda (default: cpu, and cuda if present)")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=list(MODE_FLAGS))
    parser.add_argument("--updates", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per script and device; the median is reported")
    parser.add_argument(
        "--threads",
        type=int,
        help="--torch-threads for the scripts (default: theirs, 0: chosen by what the other processes leave idle)",
    )
    parser.add_argument(
        "--together",
        type=int,
        default=1,
        help="copies of each measured run started at once, as a sweep runs them side by side (default: 1); every "
        "copy's steps/s counts in the median and range",
    )
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy processes running beside the measurement, as on a shared machine (default: 0)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmark" / "results" / "speed.md"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child[:2], args.updates, args.threads, args.child[2])
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    import torch

    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    machine = torch.cuda.get_device_name() if "cuda" in devices else f"{platform.processor() or platform.machine()}"
    header = (
        f"\n## {datetime.date.today()}: {os.cpu_count()} cores, {machine}, torch {torch.__version__}, "
        f"--torch-threads {'default' if args.threads is None else args.threads}, {args.load} busy processes "
        f"beside, {args.together} at once, {args.updates} updates, median of {args.repeats * args.together} runs\n\n"
        "| script | device | mode | steps/s (median) | range | steps/s steady (median) | peak RSS (MiB) | "
        "peak CUDA (MiB) |\n|---|---|---|---|---|---|---|---|\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write(args.out, header)  # then each row as it comes: a run that fails or is killed loses none before it
    failed = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    for script, device, mode in [
        (s, d, m) for s in args.scripts for d in devices for m in args.modes if d == "cuda" or "cudagraphs" not in m
    ]:
        runs = []
        command = [sys.executable, __file__, "--child", script, device, mode, "--updates", str(args.updates), *threads]
        for _ in range(args.repeats):
            copies = [
                subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.mkdtemp()
                )
                for _ in range(args.together)
            ]
            for copy in copies:
                stdout, stderr = copy.communicate()
                if copy.returncode:
                    failed.append(f"{script} on {device} ({mode}) failed:\n{stderr[-3000:]}")
                    print(failed[-1], file=sys.stderr, flush=True)
                else:
                    runs.append(json.loads(stdout.strip().splitlines()[-1]))
        if len(runs) < args.repeats * args.together:
            write(args.out, f"| {script} | {device} | {mode} | failed | | | | |\n")
            continue
        sps, steady = sorted(m["sps"] for m in runs), statistics.median(m["steady_sps"] for m in runs)
        cuda = f"{max(m['peak_cuda_mib'] for m in runs):.0f}" if device == "cuda" else "-"
        write(
            args.out,
            f"| {script} | {device} | {mode} | {statistics.median(sps):.0f} | {sps[0]:.0f}-{sps[-1]:.0f} | "
            f"{steady:.0f} | {max(m['peak_rss_mib'] for m in runs):.0f} | {cuda} |\n",
        )
    for process in busy:
        process.kill()
    print(f"appended to {args.out}")
    if failed:
        sys.exit(f"{len(failed)} of the table's rows failed (their errors above)")


def write(path, text):
    """Append `text` to the table at `path` and print it."""
    print(text, end="", flush=True)
    with open(path, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()

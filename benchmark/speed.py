"""Speed and memory of the algorithm scripts on one fixed workload, written as a markdown table.

Workload: Hopper-v4 (CartPole-v1 for sac_discrete.py), 1 env, batch 256, default networks, --learning-starts
1000 random steps, then --updates env steps with the script's updates (one per env step), no periodic
evaluation. ERL: its default population of 10 and one learner on Hopper-v4; it runs whole generations, so it
may take a few more steps; its steps/s counts population, learner and update time alike. Steps/s is the script's own
charts/SPS: env steps per second counted from the first gradient update, read from its TensorBoard log.
Steps/s "steady" counts only the second half of the updates, timed by each charts/SPS event's wall time: it leaves
out --compile's compilation and a CUDA graph's capture. Peak memory is the process's maximum resident set (CPU) and
torch's peak allocation (CUDA). --modes runs the updates eagerly (this tool's default; --no-cudagraphs), with
--compile, --cudagraphs (the scripts' default on a GPU) or both, and each with +deterministic (--torch-deterministic).

--together N [N ...] starts N copies of each run at once, as benchmark/sweep.py --runs-per-gpu N runs them: on a GPU
each copy pinned to a core of its own (--threads of them) and all on the first GPU, without and with an MPS daemon
for it (--mps); a row per count gives the copies' total steady steps/s, its multiple of one copy's (the count 1's
row), and each copy's.

    python benchmark/speed.py                       # every script, CPU, and CUDA when present
    python benchmark/speed.py --scripts td3_continuous.py --devices cpu --updates 3000
    python benchmark/speed.py --threads 1 --together 1 2        # one run, then two side by side, one thread each
    python benchmark/speed.py --devices cuda --modes eager compile cudagraphs compile+cudagraphs
    python benchmark/speed.py --scripts td3_continuous.py td7_continuous.py --devices cuda --modes cudagraphs \
        --threads 1 --together 1 2 4 8 16 --mps off on --repeats 1   # how many runs fill a GPU
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
sys.path.insert(0, str(REPO))
from benchmark.sweep import places, start_mps, stop_mps, visible_gpus  # noqa: E402

WORKLOAD_ENV = {
    "td3_continuous.py": "Hopper-v4",
    "td7_continuous.py": "Hopper-v4",
    "sac_continuous.py": "Hopper-v4",
    "sac_discrete.py": "CartPole-v1",
    "erl_td3.py": "Hopper-v4",
}


# --cudagraphs is the scripts' default on a GPU (the CPU ignores it), so eager names its opposite; a mode's
# "+deterministic" twin adds --torch-deterministic (off by default), to price it on a GPU.
MODE_FLAGS = {
    "eager": ["--no-cudagraphs"],
    "compile": ["--compile", "--no-cudagraphs"],
    "cudagraphs": ["--cudagraphs"],
    "compile+cudagraphs": ["--compile", "--cudagraphs"],
}
MODE_FLAGS |= {f"{mode}+deterministic": flags + ["--torch-deterministic"] for mode, flags in list(MODE_FLAGS.items())}


def steady_sps(points):
    """Steps/s over the second half of the updates, from charts/SPS's points as (step, the event's wall time): the env
    steps between the point nearest the middle and the last, over the seconds between them. The first point marks
    the start (TD7's first update is at the first episode end after --learning-starts, not at it), and a burst of
    updates logs many points at one step (TD7 updates at an episode's end): a step's time is its last point's, when
    its burst ended."""
    times = dict(points)  # the last point of each step
    first, end = min(times), max(times)
    middle = min(times, key=lambda step: abs(step - (first + end) / 2))
    return (end - middle) / (times[end] - times[middle]) if times[end] > times[middle] else float("nan")


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
    points = events.Scalars("charts/SPS")
    print(
        json.dumps(
            {
                "sps": points[-1].value,
                "steady_sps": steady_sps([(e.step, e.wall_time) for e in points]),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
            }
        )
    )


def together(copies, one=None):
    """The figures of copies run at once, from `copies` (a list per repeat of each copy's measurements) and `one`,
    the total of one copy alone: the median over the repeats of the copies' total steady steps/s, that over `one`,
    each copy's steady steps/s (sorted), and the slowest over the fastest."""
    total = statistics.median(sum(m["steady_sps"] for m in repeat) for repeat in copies)
    each = sorted(m["steady_sps"] for repeat in copies for m in repeat)
    return total, total / one if one else None, each, each[0] / each[-1]


def start_copies(command, count, device, threads, mps):
    """`count` copies of a measured run started at once; on a GPU placed as sweep.py --runs-per-gpu places them
    (the first GPU, a core each, through its MPS daemon when `mps` has one)."""
    gpus = visible_gpus()[:1] if device == "cuda" else []
    slots = places(gpus, count, threads or 1, sorted(os.sched_getaffinity(0))) if gpus else None
    if gpus and slots is None:
        print(f"{count} copies do not fit a core each on this machine: they run unpinned", file=sys.stderr)
    return [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tempfile.mkdtemp(),
            **(slots[k].popen(mps, os.environ) if slots else {}),
        )
        for k in range(count)
    ]


def main(argv=None):
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
        nargs="+",
        type=int,
        help="copies of each measured run started at once, a row per count (e.g. 1 2 4 8 16): their total steady "
        "steps/s, its multiple of one copy's, and each copy's (default: one run at a time, the plain table)",
    )
    parser.add_argument(
        "--mps",
        nargs="+",
        choices=["off", "on"],
        help="with --together on a GPU: without and/or with an MPS control daemon for it (default: both on a GPU "
        "with a count above 1, else off)",
    )
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy processes running beside the measurement, as on a shared machine (default: 0)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmark" / "results" / "speed.md"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child[:2], args.updates, args.threads, args.child[2])
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    import torch

    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    machine = torch.cuda.get_device_name() if "cuda" in devices else f"{platform.processor() or platform.machine()}"
    counts = sorted(set(args.together or [1]))  # 1 first: the others' multiple is of its total
    header = (
        f"\n## {datetime.date.today()}: {os.cpu_count()} cores, {machine}, torch {torch.__version__}, "
        f"--torch-threads {'default' if args.threads is None else args.threads}, {args.load} busy processes "
        f"beside, {' / '.join(map(str, counts))} at once, {args.updates} updates, "
    )
    if args.together:
        header += (
            f"median total of {args.repeats} repeats\n\n| script | device | mode | MPS | at once | total steps/s "
            "steady | x one run | each run's steps/s steady | slowest / fastest | peak RSS (MiB) | peak CUDA (MiB) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
    else:
        header += (
            f"median of {args.repeats} runs\n\n| script | device | mode | steps/s (median) | range | steps/s steady "
            "(median) | peak RSS (MiB) | peak CUDA (MiB) |\n|---|---|---|---|---|---|---|---|\n"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write(args.out, header)  # then each row as it comes: a run that fails or is killed loses none before it
    failed = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    for script, device, mode in [
        (s, d, m)
        for s in args.scripts
        for d in devices
        for m in args.modes
        if d == "cuda" or not {"cudagraphs", "deterministic"} & set(m.split("+"))  # (the CPU has neither)
    ]:
        command = [sys.executable, __file__, "--child", script, device, mode, "--updates", str(args.updates), *threads]
        for mps in args.mps or (["off", "on"] if device == "cuda" and max(counts) > 1 else ["off"]):
            if mps == "on" and device != "cuda":
                print(f"MPS is for a GPU: no {script} row on {device} with MPS on", flush=True)
                continue
            daemon = start_mps(visible_gpus()[:1], tempfile.mkdtemp(), print) if mps == "on" else {}
            if mps == "on" and not daemon:
                print(f"no MPS daemon started: no {script} rows on {device} ({mode}) with MPS on", flush=True)
                continue
            one = None
            try:
                for count in counts:
                    runs = []
                    for _ in range(args.repeats):
                        copies = start_copies(command, count, device, args.threads, daemon)
                        runs.append([])
                        for copy in copies:
                            stdout, stderr = copy.communicate()
                            if copy.returncode:
                                failed.append(f"{script} on {device} ({mode}) failed:\n{stderr[-3000:]}")
                                print(failed[-1], file=sys.stderr, flush=True)
                            else:
                                runs[-1].append(json.loads(stdout.strip().splitlines()[-1]))
                        if args.together:
                            each = ", ".join(f"{m['steady_sps']:.0f}" for m in runs[-1])
                            print(f"{script} {device} {mode}, MPS {mps}, {count} at once: each {each} steps/s steady")
                    row = write_row(args, script, device, mode, mps, count, runs, one)
                    one = row if count == 1 else one
            finally:
                stop_mps(daemon, print)
    for process in busy:
        process.kill()
    print(f"appended to {args.out}")
    if failed:
        sys.exit(f"{len(failed)} of the table's rows failed (their errors above)")


def write_row(args, script, device, mode, mps, count, runs, one):
    """The table's row of `count` copies measured `args.repeats` times (`runs`: each repeat's measurements); returns
    the copies' median total steady steps/s (None where a copy failed)."""
    flat = [m for repeat in runs for m in repeat]
    if len(flat) < args.repeats * count:
        write(args.out, f"| {script} | {device} | {mode} |{f' {mps} | {count} |' if args.together else ''} failed |\n")
        return None
    rss = f"{max(m['peak_rss_mib'] for m in flat):.0f}"
    cuda = f"{max(m['peak_cuda_mib'] for m in flat):.0f}" if device == "cuda" else "-"
    if args.together:
        total, times, each, spread = together(runs, one)
        times = "-" if times is None else f"{times:.2f}"
        each = f"{each[0]:.0f}" if len(each) == 1 else f"{each[0]:.0f}-{each[-1]:.0f}"
        write(
            args.out,
            f"| {script} | {device} | {mode} | {mps} | {count} | {total:.0f} | {times} | {each} | {spread:.2f} | "
            f"{rss} | {cuda} |\n",
        )
        return total
    sps, steady = sorted(m["sps"] for m in flat), statistics.median(m["steady_sps"] for m in flat)
    write(
        args.out,
        f"| {script} | {device} | {mode} | {statistics.median(sps):.0f} | {sps[0]:.0f}-{sps[-1]:.0f} | "
        f"{steady:.0f} | {rss} | {cuda} |\n",
    )
    return None


def write(path, text):
    """Append `text` to the table at `path` and print it."""
    print(text, end="", flush=True)
    with open(path, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()

"""Run one algorithm script over env ids x seeds, several runs at a time, and say which failed.

    python benchmark/sweep.py td3_continuous.py --envs Hopper-v4 Walker2d-v4 --seeds 1 2 3 --workers 2 \
        -- --total-timesteps 300000

Each run gets --env-id, --seed and --torch-threads (the machine's cores shared among the workers; OMP and
MKL threads likewise), plus the flags after `--`. A run is skipped when runs/ already holds its finished
result (an evaluations.csv whose last row reached the run's total_timesteps), so a sweep can be started
again after an interruption. Logs go to benchmark/logs/{exp_name}__{env}__{seed}.log.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def finished(runs_dir, env_id, exp_name, seed):
    """True when runs_dir holds a run of (env_id, exp_name, seed) whose last evaluation reached its total steps."""
    for run in Path(runs_dir).glob(f"{env_id.replace('/', '-').replace(':', '-')}__{exp_name}__{seed}__*"):
        try:
            total = json.loads((run / "args.json").read_text())["total_timesteps"]
            with open(run / "evaluations.csv") as f:
                rows = list(csv.DictReader(f))
        except (OSError, KeyError, ValueError):
            continue
        if rows and int(rows[-1]["global_step"]) >= total:
            return True
    return False


def exp_name_of(script, flags):
    return flags[flags.index("--exp-name") + 1] if "--exp-name" in flags else Path(script).stem


def run_one(script, env_id, seed, flags, threads, logs):
    log = Path(logs) / f"{exp_name_of(script, flags)}__{env_id.replace('/', '-')}__{seed}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(REPO / script), "--env-id", env_id, "--seed", str(seed), "--torch-threads", str(threads),
           *flags]
    with open(log, "w") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode, log


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="e.g. td3_continuous.py")
    parser.add_argument("--envs", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    parser.add_argument("--logs", default="benchmark/logs")
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not (REPO / args.script).is_file() or args.workers < 1:
        parser.error(f"no script {args.script} in {REPO}" if args.workers >= 1 else "--workers must be positive")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    exp_name = exp_name_of(args.script, flags)
    todo, skipped = [], 0
    for env_id in args.envs:
        for seed in args.seeds:
            if finished("runs", env_id, exp_name, seed):
                skipped += 1
            else:
                todo.append((env_id, seed))
    print(f"{len(todo)} runs to do, {skipped} already finished; {args.workers} at a time, {threads} threads each")
    failed = []
    with ThreadPoolExecutor(args.workers) as pool:
        futures = {pool.submit(run_one, args.script, e, s, flags, threads, args.logs): (e, s) for e, s in todo}
        for future, (env_id, seed) in futures.items():
            returncode, log = future.result()
            print(f"{'done  ' if returncode == 0 else 'FAILED'} {env_id} seed {seed}" +
                  ("" if returncode == 0 else f" (exit {returncode}, log {log})"), flush=True)
            if returncode:
                failed.append((env_id, seed))
    if failed:
        sys.exit(f"{len(failed)} of {len(todo)} runs failed: " + ", ".join(f"{e} seed {s}" for e, s in failed))


if __name__ == "__main__":
    main()

"""Run one algorithm script over env ids x seeds: several runs at a time on this machine, or a Slurm job array.

    python benchmark/sweep.py td3_continuous.py --envs Hopper-v4 Walker2d-v4 --seeds 1 2 3 --workers 2 \
        -- --total-timesteps 300000
    python benchmark/sweep.py td3_continuous.py --slurm --time 24:00:00 --cpus-per-task 2 --gpus 1 \
        -- --total-timesteps 1000000

--envs takes env ids or the names of sets (mujoco, classic, atari); without it, a script runs on its own set
(classic for sac_discrete.py, mujoco for the others), with seeds 1 2 3 unless --seeds says otherwise. Each run
gets --env-id, --seed and --torch-threads (the CPUs this process may use, shared among the workers; OMP and MKL
threads likewise), plus the flags after `--`. A sweep owns its directory, --dir (default: sweeps/{exp_name}): its
runs go to {dir}/runs/ and their logs to {dir}/logs/{exp_name}__{env}__{seed}.log, so that ad-hoc runs in ./runs
and other sweeps never mix with it. A run is skipped when the sweep's runs/ already holds its finished result (an
evaluations.csv whose last row reached the run's total_timesteps), and an unfinished run that left a checkpoint.pt
is resumed from it, so a sweep can simply be started again after an interruption or a pre-emption.

With --slurm, the same runs become one `sbatch` job array: task i runs this file in local mode for the i-th
(env, seed), so skipping and resuming work the same way there. Slurm sends SIGTERM --signal-before seconds
before the time limit, which makes the scripts write a checkpoint; with --requeue the task then starts again
and resumes. --wait blocks until the whole array has finished.
"""
import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_SETS = {
    "mujoco": ["Hopper-v4", "HalfCheetah-v4", "Walker2d-v4", "Ant-v4", "Humanoid-v4"],
    "classic": ["CartPole-v1", "Acrobot-v1", "MountainCar-v0"],
    "atari": ["PongNoFrameskip-v4", "BreakoutNoFrameskip-v4", "BeamRiderNoFrameskip-v4"],
}


def run_dirs(runs_dir, env_id, exp_name, seed):
    return sorted(Path(runs_dir).glob(f"{env_id.replace('/', '-').replace(':', '-')}__{exp_name}__{seed}__*"))


def finished(run):
    """True when the run's last evaluation reached its total steps."""
    try:
        total = json.loads((run / "args.json").read_text())["total_timesteps"]
        with open(run / "evaluations.csv") as f:
            rows = list(csv.DictReader(f))
    except (OSError, KeyError, ValueError):
        return False
    return bool(rows) and int(rows[-1]["global_step"]) >= total


def state_of(runs_dir, env_id, exp_name, seed):
    """("finished", run), ("resume", checkpoint of the latest unfinished run), or ("new", None)."""
    runs = run_dirs(runs_dir, env_id, exp_name, seed)
    if any(finished(run) for run in runs):
        return "finished", None
    checkpoints = [run / "checkpoint.pt" for run in runs if (run / "checkpoint.pt").exists()]
    return ("resume", checkpoints[-1]) if checkpoints else ("new", None)


def exp_name_of(script, flags):
    return flags[flags.index("--exp-name") + 1] if "--exp-name" in flags else Path(script).stem


def run_one(script, env_id, seed, flags, threads, directory, logs, checkpoint=None):
    """One run, in the sweep's directory (so into its runs/), its output into the sweep's log of that run."""
    log = Path(logs) / f"{exp_name_of(script, flags)}__{env_id.replace('/', '-')}__{seed}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(REPO / script), "--env-id", env_id, "--seed", str(seed), "--torch-threads", str(threads),
           *flags, *(["--resume", str(Path(checkpoint).resolve())] if checkpoint else [])]
    with open(log, "a" if checkpoint else "w") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=directory).returncode, log


def run_local(args, flags, runs):
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", 0)) or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    threads = max(1, cpus // args.workers)
    exp_name = exp_name_of(args.script, flags)
    todo, skipped = [], 0
    for env_id, seed in runs:
        state, checkpoint = state_of(Path(args.dir) / "runs", env_id, exp_name, seed)
        if state == "finished":
            skipped += 1
        else:
            todo.append((env_id, seed, checkpoint))
    print(f"{len(todo)} runs to do ({sum(c is not None for *_, c in todo)} resumed), {skipped} already finished; "
          f"{args.workers} at a time, {threads} threads each", flush=True)
    failed = []
    with ThreadPoolExecutor(args.workers) as pool:
        futures = {pool.submit(run_one, args.script, e, s, flags, threads, args.dir, args.logs, c): (e, s)
                   for e, s, c in todo}
        for future, (env_id, seed) in futures.items():
            returncode, log = future.result()
            print(f"{'done  ' if returncode == 0 else 'FAILED'} {env_id} seed {seed}" +
                  ("" if returncode == 0 else f" (exit {returncode}, log {log})"), flush=True)
            if returncode:
                failed.append((env_id, seed))
    if failed:
        sys.exit(f"{len(failed)} of {len(todo)} runs failed: " + ", ".join(f"{e} seed {s}" for e, s in failed))


def slurm_job(args, flags, runs):
    """The sbatch script of the job array: task i runs the i-th (env, seed) through this file in local mode."""
    exp_name = exp_name_of(args.script, flags)
    logs = Path(args.logs).resolve()
    directives = [f"--job-name={exp_name}", f"--array=0-{len(runs) - 1}%{args.max_parallel}" if args.max_parallel
                  else f"--array=0-{len(runs) - 1}", f"--time={args.time}", f"--cpus-per-task={args.cpus_per_task}",
                  f"--mem={args.mem}", f"--output={logs}/slurm-%A_%a.out",
                  f"--signal=TERM@{args.signal_before}"]  # SIGTERM before the limit: the run checkpoints
    directives += [f"--gres=gpu:{args.gpus}"] if args.gpus else []
    directives += [f"--partition={args.partition}"] if args.partition else []
    directives += ["--requeue"] if args.requeue else []
    directives += args.sbatch_arg
    lines = ["#!/usr/bin/env bash"] + [f"#SBATCH {d}" for d in directives]
    lines += [f"ENVS=({' '.join(shlex.quote(e) for e, _ in runs)})", f"SEEDS=({' '.join(str(s) for _, s in runs)})",
              f"exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
              f"{shlex.quote(args.script)} --envs \"${{ENVS[$SLURM_ARRAY_TASK_ID]}}\" "
              f"--seeds \"${{SEEDS[$SLURM_ARRAY_TASK_ID]}}\" --workers 1 "
              f"--dir {shlex.quote(str(Path(args.dir).resolve()))} --logs {shlex.quote(str(logs))} -- "
              + " ".join(shlex.quote(f) for f in flags)]
    return "\n".join(lines) + "\n"


def run_slurm(args, flags, runs):
    exp_name = exp_name_of(args.script, flags)
    todo = [(e, s) for e, s in runs if state_of(Path(args.dir) / "runs", e, exp_name, s)[0] != "finished"]
    print(f"{len(todo)} runs to submit, {len(runs) - len(todo)} already finished", flush=True)
    if not todo:
        return
    job_file = Path(args.logs) / f"{exp_name}.sbatch"
    job_file.write_text(slurm_job(args, flags, todo))
    result = subprocess.run(["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(job_file)],
                            capture_output=True, text=True)
    job_id = result.stdout.strip().split(";")[0]
    if result.returncode and not job_id:
        sys.exit(f"sbatch failed: {result.stderr.strip()}")
    print(f"submitted job array {job_id} ({len(todo)} tasks): {job_file}; logs in {args.logs}", flush=True)
    if args.wait:
        missing = [(e, s) for e, s in todo if state_of(Path(args.dir) / "runs", e, exp_name, s)[0] != "finished"]
        if missing or result.returncode:
            sys.exit(f"{len(missing)} of {len(todo)} runs did not finish: " +
                     ", ".join(f"{e} seed {s}" for e, s in missing) + f" (see {args.logs}/slurm-{job_id}_*.out)")
        print(f"all {len(todo)} runs finished", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="e.g. td3_continuous.py")
    parser.add_argument("--envs", nargs="+", help=f"env ids, or sets: {', '.join(ENV_SETS)} (default: classic for "
                        "sac_discrete.py, mujoco for the others)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="default: 1 2 3")
    parser.add_argument("--workers", type=int, default=1, help="local runs at a time")
    parser.add_argument("--dir", help="the sweep's directory, which holds its runs/ and logs/ (default: "
                        "sweeps/{exp_name}); runs outside it are never skipped, resumed or reported with it")
    parser.add_argument("--logs", help="the runs' logs and Slurm's output (default: {dir}/logs)")
    slurm = parser.add_argument_group("Slurm (with --slurm)")
    slurm.add_argument("--slurm", action="store_true", help="submit the runs as a Slurm job array")
    slurm.add_argument("--time", default="24:00:00", help="time limit per run")
    slurm.add_argument("--cpus-per-task", type=int, default=2)
    slurm.add_argument("--mem", default="8G", help="memory per run")
    slurm.add_argument("--gpus", type=int, default=0, help="GPUs per run (--gres=gpu:N)")
    slurm.add_argument("--partition")
    slurm.add_argument("--max-parallel", type=int, help="at most this many tasks at once (--array=...%%N)")
    slurm.add_argument("--signal-before", type=int, default=300, help="SIGTERM this many seconds before the limit")
    slurm.add_argument("--requeue", action="store_true", help="requeue pre-empted tasks (they resume)")
    slurm.add_argument("--wait", action="store_true", help="block until the array has finished; check the results")
    slurm.add_argument("--sbatch-arg", action="append", default=[], help="one more sbatch directive, e.g. --qos=long")
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not (REPO / args.script).is_file():
        parser.error(f"no script {args.script} in {REPO}")
    if args.workers < 1:
        parser.error("--workers must be positive")
    names = args.envs or (["classic"] if Path(args.script).stem == "sac_discrete" else ["mujoco"])
    envs = [env for name in names for env in ENV_SETS.get(name, [name])]
    runs = [(env_id, seed) for env_id in envs for seed in args.seeds]
    args.dir = args.dir or str(Path("sweeps") / exp_name_of(args.script, flags))
    args.logs = args.logs or str(Path(args.dir) / "logs")
    for folder in (args.dir, args.logs):
        Path(folder).mkdir(parents=True, exist_ok=True)
    (run_slurm if args.slurm else run_local)(args, flags, runs)


if __name__ == "__main__":
    main()

"""Run one algorithm script over env ids x seeds: several runs at a time on this machine, or a Slurm job array.

    python benchmark/sweep.py td3_continuous.py --envs Hopper-v4 Walker2d-v4 --seeds 1 2 3 --workers 2 \
        -- --total-timesteps 300000
    python benchmark/sweep.py td3_continuous.py --slurm --time 24:00:00 --cpus-per-task 2 --gpus 1 \
        -- --total-timesteps 1000000

--envs takes env ids or the names of sets (mujoco, classic, atari); without it, a script runs on its own set
(classic for sac_discrete.py, mujoco for the others), with seeds 1 2 3 unless --seeds says otherwise. Each run
gets --env-id, --seed and --torch-threads (--threads, default 1: one thread per run does not slow down beside
other work; OMP and MKL threads likewise), plus the flags after `--`, which go to every run. --workers runs go at
once (default: the CPUs this process may use, divided by --threads). Ctrl-C or SIGTERM stops the sweep: every
running run gets the signal and writes its checkpoint, nothing new starts, and a restarted sweep resumes them. One
sweep at a time works in a directory (a lock). A sweep owns its directory, --dir (default: sweeps/{exp_name}): its
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
import contextlib
import csv
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_SETS = {
    "mujoco": ["Hopper-v4", "HalfCheetah-v4", "Walker2d-v4", "Ant-v4", "Humanoid-v4"],
    "classic": ["CartPole-v1", "Acrobot-v1", "MountainCar-v0"],
    "atari": ["PongNoFrameskip-v4", "BreakoutNoFrameskip-v4", "BeamRiderNoFrameskip-v4"],
}


def run_dirs(runs_dir, env_id, exp_name, seed):
    """The run directories of (env_id, exp_name, seed), matched literally: {env}__{exp_name}__{seed}__{time}[-N]."""
    prefix = f"{env_id.replace('/', '-').replace(':', '-')}__{exp_name}__{seed}__"
    runs_dir = Path(runs_dir)
    names = os.listdir(runs_dir) if runs_dir.is_dir() else []
    return sorted(runs_dir / n for n in names if n.startswith(prefix) and re.fullmatch(r"\d+(-\d+)?", n[len(prefix) :]))


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


def run_command(script, env_id, seed, flags, threads, checkpoint=None):
    """The command line of one run (resuming `checkpoint` when given)."""
    resume = ["--resume", str(Path(checkpoint).resolve())] if checkpoint else []
    common = ["--env-id", env_id, "--seed", str(seed), "--torch-threads", str(threads)]
    return [sys.executable, str(REPO / script), *common, *flags, *resume]


def start_run(script, env_id, seed, flags, threads, directory, logs, checkpoint=None):
    """Start one run in the sweep's directory (so into its runs/), its output into the sweep's log of that run, in a
    session of its own: a signal reaches it only when the sweep passes it on."""
    log = Path(logs) / f"{exp_name_of(script, flags)}__{env_id.replace('/', '-')}__{seed}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = run_command(script, env_id, seed, flags, threads, checkpoint)
    with open(log, "a" if checkpoint else "w") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=directory, start_new_session=True
        )
    return process, log


def last_line(log):
    """The last line a run wrote to its log (its progress line, less the bar's blocks), or ''."""
    with contextlib.suppress(OSError):
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = f.read().decode(errors="replace").replace("\r", "\n").split("\n")
            line = next((line.strip() for line in reversed(lines) if line.strip()), "")
            return re.sub(r"^\s*\d+%\|[^|]*\|\s*", "", line)  # "25%|██▌       | 75000/300000 steps, ETA ..."
    return ""


class Status:
    """What the sweep shows: on a terminal one status line rewritten in place (done, running, failed, to go, and
    each running run's last progress); in a log one line per change."""

    def __init__(self, total):
        self.total, self.tty, self.shown = total, sys.stdout.isatty(), None
        self.columns = shutil.get_terminal_size().columns

    def say(self, line):
        print(("\r\033[K" if self.tty else "") + line, flush=True)
        self.shown = None

    def update(self, done, failed, running):
        left = self.total - done - failed - len(running)
        counts = f"{done} done, {len(running)} running, {failed} failed, {left} to go"
        if self.tty:  # each running run's last progress in an equal share of the terminal's width
            share = max(10, (self.columns - 1 - len(counts)) // max(len(running), 1) - 3)
            runs = "".join(f" | {f'{e} {s}: {last_line(log)}'[:share]}" for (e, s), (_, log) in running.items())
            print("\r\033[K" + f"{counts}{runs}"[: self.columns - 1], end="", flush=True)
        elif counts != self.shown:
            print(counts, flush=True)
            self.shown = counts


def run_local(args, flags, runs):
    exp_name = exp_name_of(args.script, flags)
    todo, skipped = [], 0
    for env_id, seed in runs:
        state, checkpoint = state_of(Path(args.dir) / "runs", env_id, exp_name, seed)
        if state == "finished":
            skipped += 1
        else:
            todo.append((env_id, seed, checkpoint))
    status = Status(len(todo))
    status.say(
        f"{len(todo)} runs to do ({sum(c is not None for *_, c in todo)} resumed), {skipped} already "
        f"finished; {args.workers} at a time, {args.threads} torch thread{'s' if args.threads > 1 else ''} "
        f"each; logs in {Path(args.logs).resolve()}"
    )
    if args.dry_run:  # every run it would start or resume, as it would start it
        for env_id, seed, checkpoint in todo:
            cmd = run_command(args.script, env_id, seed, flags, args.threads, checkpoint)
            status.say(f"{'resume' if checkpoint else 'start'} {env_id} seed {seed} in {args.dir}: {shlex.join(cmd)}")
        return
    stop = []  # the signal that stops the sweep, once one arrives
    handlers = {s: signal.signal(s, lambda signum, frame: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    running, failed, done = {}, [], 0
    try:
        while (todo and not stop) or running:
            while todo and not stop and len(running) < args.workers:
                env_id, seed, checkpoint = todo.pop(0)
                running[env_id, seed] = start_run(
                    args.script, env_id, seed, flags, args.threads, args.dir, args.logs, checkpoint
                )
            if stop and not any(getattr(p, "signalled", False) for p, _ in running.values()):
                status.say(
                    f"{signal.Signals(stop[0]).name}: passing it to the {len(running)} running runs, which "
                    "write their checkpoints; nothing new starts"
                )
                for process, _ in running.values():
                    process.send_signal(stop[0])
                    process.signalled = True
            for (env_id, seed), (process, log) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[env_id, seed]
                if process.returncode == 0:
                    done += 1
                    status.say(f"done   {env_id} seed {seed}")
                elif getattr(process, "signalled", False):
                    status.say(f"stopped {env_id} seed {seed}: checkpoint written, resumed when the sweep runs again")
                else:
                    failed.append((env_id, seed))
                    status.say(f"FAILED {env_id} seed {seed} (exit {process.returncode}, log {log})")
            status.update(done, len(failed), running)
            time.sleep(0.2)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if status.tty:
        print()
    if stop:
        print(
            f"sweep stopped by {signal.Signals(stop[0]).name}: {done} done, {len(failed)} failed, "
            f"{len(todo)} not started; start it again to go on",
            file=sys.stderr,
        )
        sys.exit(128 + stop[0])
    if failed:  # in the sweep's order, not the order they ended in
        failed.sort(key=runs.index)
        sys.exit(f"{len(failed)} of {len(failed) + done} runs failed: " + ", ".join(f"{e} seed {s}" for e, s in failed))


def lock_sweep(directory):
    """One sweep at a time in a directory: its lock is held until this process ends."""
    fd = os.open(Path(directory) / "sweep.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"error: another sweep works in {directory}: {os.read(fd, 100).decode() or 'its process'}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()}".encode(), 0)
    return fd


def slurm_job(args, flags, runs):
    """The sbatch script of the job array: task i runs the i-th (env, seed) through this file in local mode."""
    exp_name = exp_name_of(args.script, flags)
    logs = Path(args.logs).resolve()
    directives = [
        f"--job-name={exp_name}",
        f"--array=0-{len(runs) - 1}%{args.max_parallel}" if args.max_parallel else f"--array=0-{len(runs) - 1}",
        f"--time={args.time}",
        f"--cpus-per-task={args.cpus_per_task}",
        f"--mem={args.mem}",
        f"--output={logs}/slurm-%A_%a.out",
        f"--signal=TERM@{args.signal_before}",
    ]  # SIGTERM before the limit: the run checkpoints
    directives += [f"--gres=gpu:{args.gpus}"] if args.gpus else []
    directives += [f"--partition={args.partition}"] if args.partition else []
    directives += ["--requeue"] if args.requeue else []
    directives += args.sbatch_arg
    lines = ["#!/usr/bin/env bash"] + [f"#SBATCH {d}" for d in directives]
    lines += [
        f"ENVS=({' '.join(shlex.quote(e) for e, _ in runs)})",
        f"SEEDS=({' '.join(str(s) for _, s in runs)})",
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
        f'{shlex.quote(args.script)} --envs "${{ENVS[$SLURM_ARRAY_TASK_ID]}}" '
        f'--seeds "${{SEEDS[$SLURM_ARRAY_TASK_ID]}}" --workers 1 --threads {args.cpus_per_task} --slurm-task '
        f"--dir {shlex.quote(str(Path(args.dir).resolve()))} --logs {shlex.quote(str(logs))} -- "
        + " ".join(shlex.quote(f) for f in flags),
    ]
    return "\n".join(lines) + "\n"


def run_slurm(args, flags, runs):
    exp_name = exp_name_of(args.script, flags)
    todo = [(e, s) for e, s in runs if state_of(Path(args.dir) / "runs", e, exp_name, s)[0] != "finished"]
    print(f"{len(todo)} runs to submit, {len(runs) - len(todo)} already finished", flush=True)
    if not todo:
        return
    job_file = Path(args.logs) / f"{exp_name}.sbatch"
    if args.dry_run:  # the job it would submit; each task resumes its run's latest checkpoint if there is one
        print(f"would submit {job_file}:\n{slurm_job(args, flags, todo)}", end="", flush=True)
        return
    if shutil.which("sbatch") is None:
        sys.exit("error: --slurm needs Slurm's sbatch on the PATH; without it, leave --slurm out to run here")
    job_file.write_text(slurm_job(args, flags, todo))
    result = subprocess.run(
        ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(job_file)], capture_output=True, text=True
    )
    job_id = result.stdout.strip().split(";")[0]
    if result.returncode and not job_id:
        sys.exit(f"sbatch failed: {result.stderr.strip()}")
    print(f"submitted job array {job_id} ({len(todo)} tasks): {job_file}; logs in {args.logs}", flush=True)
    if args.wait:
        missing = [(e, s) for e, s in todo if state_of(Path(args.dir) / "runs", e, exp_name, s)[0] != "finished"]
        if missing or result.returncode:
            sys.exit(
                f"{len(missing)} of {len(todo)} runs did not finish: "
                + ", ".join(f"{e} seed {s}" for e, s in missing)
                + f" (see {args.logs}/slurm-{job_id}_*.out)"
            )
        print(f"all {len(todo)} runs finished", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s SCRIPT [options] [-- FLAGS FOR EVERY RUN]",
        epilog="Flags after `--` go to every run, e.g.:\n  python benchmark/sweep.py td3_continuous.py "
        "--envs Hopper-v4 --seeds 1 2 3 -- --total-timesteps 100000",
    )
    parser.add_argument("script", help="e.g. td3_continuous.py")
    parser.add_argument(
        "--envs",
        nargs="+",
        help=f"env ids, or sets: {', '.join(ENV_SETS)} (default: classic for sac_discrete.py, mujoco for the others)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="default: 1 2 3")
    parser.add_argument(
        "--workers",
        type=int,
        help="local runs at a time (default: the CPUs this process may use, divided by --threads)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument(
        "--dir",
        help="the sweep's directory, which holds its runs/ and logs/ (default: "
        "sweeps/{exp_name}); runs outside it are never skipped, resumed or reported with it",
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would run, and run nothing")
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
    slurm.add_argument("--slurm-task", action="store_true", help=argparse.SUPPRESS)  # set in the job array's tasks
    slurm.add_argument("--sbatch-arg", action="append", default=[], help="one more sbatch directive, e.g. --qos=long")
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not (REPO / args.script).is_file():
        parser.error(f"no script {args.script} in {REPO}")
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", 0)) or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    if args.threads < 1:
        parser.error("--threads must be positive")
    args.workers = max(1, cpus // args.threads) if args.workers is None else args.workers
    if args.workers < 1:
        parser.error("--workers must be positive")
    names = args.envs or (["classic"] if Path(args.script).stem == "sac_discrete" else ["mujoco"])
    envs = [env for name in names for env in ENV_SETS.get(name, [name])]
    runs = [(env_id, seed) for env_id in envs for seed in args.seeds]
    args.dir = args.dir or str(Path("sweeps") / exp_name_of(args.script, flags))
    args.logs = args.logs or str(Path(args.dir) / "logs")
    for folder in (args.dir, args.logs):
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(f"error: cannot use {folder} as a sweep directory: {e.strerror}")
    lock = None if args.slurm_task or args.dry_run else lock_sweep(args.dir)  # a Slurm task: under its array's
    (run_slurm if args.slurm else run_local)(args, flags, runs)
    if lock is not None:
        os.close(lock)


if __name__ == "__main__":
    main()

"""Run one algorithm script over env ids x seeds: several runs at a time on this machine, or a Slurm job array.

    python benchmark/sweep.py td3_continuous.py --envs Hopper-v4 Walker2d-v4 --seeds 1 2 3 --workers 2 \
        -- --total-timesteps 300000
    python benchmark/sweep.py td3_continuous.py --envs mujoco --seeds 1 2 3 4 --runs-per-gpu 8
    python benchmark/sweep.py td3_continuous.py --slurm --time 24:00:00 --cpus-per-task 2 --gpus 1 \
        -- --total-timesteps 1000000
    python benchmark/sweep.py td3_continuous.py --slurm --runs-per-gpu 8 --time 24:00:00   # 8 runs per task's GPU

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

Filling GPUs: one run uses a sliver of a modern GPU, so --runs-per-gpu N runs N at once on each GPU it sees
(CUDA_VISIBLE_DEVICES's, else nvidia-smi -L's; --gpu-ids to choose), the GPUs taken in turn, each run pinned to
--threads CPU cores of its own (N x GPUs x --threads cores in all, or it says so and stops) and shown only its GPU.
The status lines and the summary at the end say which GPU and cores each run had. Without a GPU it says so in one
line and runs as without --runs-per-gpu. Processes on one GPU time-slice it: one runs its kernels at a time. CUDA's
Multi-Process Service (MPS) runs the kernels of several processes side by side, which small-kernel work like these
updates needs; so with two or more runs per GPU the sweep starts an MPS control daemon for each GPU
(nvidia-cuda-mps-control -d, its pipe and log directories under {dir}/mps/, the pipe in /tmp where its socket's path
would be too long, the daemon shown its GPU and the runs pointed to its pipe, as NVIDIA's guide sets it up) and stops it
(echo quit | nvidia-cuda-mps-control) when the sweep ends, Ctrl-C and SIGTERM included. It says in one line when it does
not: no nvidia-cuda-mps-control on the PATH, a daemon that it did not start answers already (the runs use that one, and
the sweep never stops it), a GPU in compute mode Prohibited, or the daemon refused to start (not allowed). --no-mps
turns it off. A GPU in exclusive-process mode takes one process only, so it needs MPS to hold more than one run.
benchmark/speed.py --together measures what N runs on one GPU make, with and without MPS.

With --slurm, the same runs become one `sbatch` job array: task i runs this file in local mode for its runs (the
i-th (env, seed); with --runs-per-gpu N, N of them on each of its --gpus, default 1, asking for N x --threads
cores), so skipping, resuming, placing and MPS work the same way there; a task with --gpus 0 sees no GPU and runs
its N runs on its cores. Slurm sends SIGTERM --signal-before seconds before the time limit, which makes every run
of the task write a checkpoint; with --requeue the task then starts again and resumes. --wait blocks until the
whole array has finished.
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
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MPS_CONTROL = "nvidia-cuda-mps-control"
TEXT = dict(capture_output=True, text=True, timeout=60)  # the GPU tools' calls: their output, never waiting long
COMPUTE_MODE = ["--query-gpu=compute_mode", "--format=csv,noheader"]  # nvidia-smi's: each GPU's, a line each
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


def start_run(script, env_id, seed, flags, threads, directory, logs, checkpoint=None, place=None, mps=None):
    """Start one run in the sweep's directory (so into its runs/), its output into the sweep's log of that run, in a
    session of its own: a signal reaches it only when the sweep passes it on. `place`, a Place, pins it to its cores
    and shows it its GPU: through the MPS daemon of that GPU when `mps` (start_mps's) has one."""
    log = Path(logs) / f"{exp_name_of(script, flags)}__{env_id.replace('/', '-')}__{seed}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    placing = place.popen(mps or {}, env) if place else {"env": env}
    cmd = run_command(script, env_id, seed, flags, threads, checkpoint)
    with open(log, "a" if checkpoint else "w") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=directory, start_new_session=True, **placing
        )
    process.place = place
    return process, log


class Gpu:
    """A GPU as the sweep names it (`name`, nvidia-smi's index) and as CUDA_VISIBLE_DEVICES selects it (`id`: its
    UUID when nvidia-smi listed it, which no enumeration order can change; else CUDA_VISIBLE_DEVICES's own entry)."""

    def __init__(self, name, id):
        self.name, self.id = name, id

    def __eq__(self, other):
        return isinstance(other, Gpu) and (self.name, self.id) == (other.name, other.id)

    def __repr__(self):
        return f"Gpu({self.name!r}, {self.id!r})"


def nvidia_smi(*args):
    """nvidia-smi's output, or None without it (or when it fails: no driver, no GPU)."""
    try:
        result = subprocess.run(["nvidia-smi", *args], **TEXT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def visible_gpus():
    """The GPUs this process may use: those CUDA_VISIBLE_DEVICES names when it is set (Slurm sets it to a task's
    GPUs; empty or -1: none), else every GPU `nvidia-smi -L` lists; none without either."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        entries = [entry.strip() for entry in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]
        return [] if not entries[0] or entries[0].startswith("-") else [Gpu(entry, entry) for entry in entries]
    listed = re.findall(r"^GPU (\d+):.*?\(UUID: ([^)]+)\)", nvidia_smi("-L") or "", re.M)
    return [Gpu(index, uuid) for index, uuid in listed]


class Place:
    """Where one run goes: its GPU and the CPU cores it is pinned to (as many as its torch threads)."""

    def __init__(self, gpu, cores):
        self.gpu, self.cores = gpu, cores

    def __str__(self):
        cores = ",".join(map(str, self.cores))
        return f"GPU {self.gpu.name}, core{'s' if len(self.cores) > 1 else ''} {cores}"

    def popen(self, mps, env):
        """Popen's `env` and `preexec_fn` for a process placed here: pinned to its cores (which all it starts
        inherit), its GPU through that GPU's MPS daemon where `mps` (GPU id -> (pipe, log directory)) has one (NVIDIA's
        per-GPU set-up: the daemon's CUDA_VISIBLE_DEVICES picks the GPU, and a client leaves it unset), else as its
        CUDA_VISIBLE_DEVICES."""
        env = dict(env, CUDA_VISIBLE_DEVICES=self.gpu.id)
        if self.gpu.id in mps:
            del env["CUDA_VISIBLE_DEVICES"]
            env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = map(str, mps[self.gpu.id])
        return {"env": env, "preexec_fn": lambda: os.sched_setaffinity(0, self.cores)}


def places(gpus, runs_per_gpu, threads, cpus):
    """The places of the runs that go at once: `runs_per_gpu` on each GPU, the GPUs taken in turn (so that fewer runs
    spread over all of them), each run with `threads` cores of its own from `cpus`. None when they do not fit."""
    count = len(gpus) * runs_per_gpu
    if count * threads > len(cpus):
        return None
    return [Place(gpus[k % len(gpus)], cpus[k * threads : (k + 1) * threads]) for k in range(count)]


def start_mps(gpus, directory, say):
    """Start an MPS control daemon for each GPU (its pipe and log directories under `directory`), unless one already
    answers where the runs would look for it (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps), which is then left to
    them and never stopped. Returns {GPU id: (pipe, log directory)} of those it started; says in one line why none."""
    if shutil.which(MPS_CONTROL) is None:
        say(f"MPS: no {MPS_CONTROL} on the PATH: the runs on a GPU share it by time-slicing")
        return {}
    existing = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if (existing / "control").exists():
        say(
            f"MPS: a control daemon that this sweep did not start answers in {existing}: the runs use it, the sweep "
            "leaves it running"
        )
        return {}
    modes = (nvidia_smi(*COMPUTE_MODE) or "").split()
    if "Prohibited" in modes:
        say("MPS: a GPU is in compute mode Prohibited (nvidia-smi -c): no process may use it, MPS neither")
        return {}
    started, root = {}, Path(directory).resolve() / "mps" / f"{os.uname().nodename}-{os.getpid()}"  # one per sweep
    for gpu in gpus:
        logs = root / f"gpu{gpu.name}"
        logs.mkdir(parents=True, exist_ok=True)
        pipe = logs / "pipe"
        if len(str(pipe / "control")) > 100:  # a unix socket's path has at most 107 bytes: the pipe in /tmp instead
            pipe = Path(tempfile.mkdtemp(prefix=f"mps-gpu{gpu.name}-"))
        pipe.mkdir(exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu.id, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
        result = subprocess.run([MPS_CONTROL, "-d"], env={**env, "CUDA_MPS_LOG_DIRECTORY": str(logs)}, **TEXT)
        if result.returncode:  # not allowed (no rights on the GPU, another user's server, ...)
            why = "".join(f": {line}" for line in (result.stderr or result.stdout).strip().splitlines()[:1])
            say(f"MPS: {MPS_CONTROL} -d failed for GPU {gpu.name} (exit {result.returncode}{why}): its runs time-slice")
            continue
        started[gpu.id] = (pipe, logs)
    if started:
        names = ", ".join(gpu.name for gpu in gpus if gpu.id in started)
        say(f"MPS: a control daemon for each of GPU {names}, logs in {root}; stopped when the sweep ends")
    return started


def stop_mps(started, say):
    """Stop the MPS control daemons this sweep started (`echo quit | nvidia-cuda-mps-control`), and no other; a pipe
    directory made in /tmp goes with its daemon."""
    for pipe, logs in started.values():
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
        result = subprocess.run([MPS_CONTROL], input="quit\n", env=env, **TEXT)
        if result.returncode:
            say(f"MPS: the daemon of {pipe} did not quit (exit {result.returncode}): `echo quit | {MPS_CONTROL}` there")
        elif pipe.parent != logs:
            shutil.rmtree(pipe, ignore_errors=True)
    started.clear()


def last_line(log):
    """The last line a run wrote to its log (its progress line, less the bar's blocks), or ''."""
    with contextlib.suppress(OSError):
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = f.read().decode(errors="replace").replace("\r", "\n").split("\n")
            line = next((line.strip() for line in reversed(lines) if line.strip()), "")
            return re.sub(r"^\s*\d+%\|[^|]*\|\s*", "", line)  # "25%|██▌       | 75000/300000 steps, ETA ..."
    return ""


def gpu_of(process):
    """' GPU 0' for a run placed on GPU 0, else ''."""
    place = getattr(process, "place", None)
    return f" GPU {place.gpu.name}" if place else ""


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
            runs = "".join(
                f" | {f'{e} {s}{gpu_of(process)}: {last_line(log)}'[:share]}"
                for (e, s), (process, log) in running.items()
            )
            print("\r\033[K" + f"{counts}{runs}"[: self.columns - 1], end="", flush=True)
        elif counts != self.shown:
            print(counts, flush=True)
            self.shown = counts


def placement(args, say):
    """The places of the runs that go at once with --runs-per-gpu on the GPUs this process sees (or those of
    --gpu-ids), or None: without --runs-per-gpu, or without a GPU (said in one line), the sweep runs as without it."""
    if args.runs_per_gpu is None:
        return None
    gpus = visible_gpus()
    if args.gpu_ids:
        unknown = [g for g in args.gpu_ids if not any(g in (gpu.name, gpu.id) for gpu in gpus)]
        if unknown:
            seen = ", ".join(gpu.name for gpu in gpus) or "none"
            sys.exit(f"error: --gpu-ids {' '.join(unknown)}: not among the GPUs seen ({seen})")
        gpus = [gpu for gpu in gpus if gpu.name in args.gpu_ids or gpu.id in args.gpu_ids]
    if not gpus:
        say(
            f"--runs-per-gpu {args.runs_per_gpu}: no GPU seen (CUDA_VISIBLE_DEVICES "
            f"{'names none' if 'CUDA_VISIBLE_DEVICES' in os.environ else 'is unset and nvidia-smi -L lists none'}), "
            "so the runs go on the CPU as without it"
        )
        return None
    cpus = sorted(os.sched_getaffinity(0))
    slots = places(gpus, args.runs_per_gpu, args.threads, cpus)
    if slots is None:
        sys.exit(
            f"error: --runs-per-gpu {args.runs_per_gpu} on {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} at --threads "
            f"{args.threads} needs {len(gpus) * args.runs_per_gpu * args.threads} cores of its own; this process may "
            f"use {len(cpus)}: ask for fewer runs per GPU, fewer --threads or fewer --gpu-ids"
        )
    return slots


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
    slots = placement(args, status.say)  # with GPUs: runs go where a slot is free, and as many at once as there are
    workers = min(len(slots), args.workers) if slots else args.workers
    status.say(
        f"{len(todo)} runs to do ({sum(c is not None for *_, c in todo)} resumed), {skipped} already "
        f"finished; {workers} at a time, {args.threads} torch thread{'s' if args.threads > 1 else ''} "
        f"each; logs in {Path(args.logs).resolve()}"
    )
    if slots:
        gpus = list({place.gpu.name: place.gpu for place in slots}.values())
        status.say(
            f"{args.runs_per_gpu} runs on each of GPU {', '.join(g.name for g in gpus)}, each run pinned to "
            f"{args.threads} core{'s' if args.threads > 1 else ''} of its own"
        )
    if args.dry_run:  # every run it would start or resume, as it would start it (the first ones: where)
        for i, (env_id, seed, checkpoint) in enumerate(todo):
            cmd = run_command(args.script, env_id, seed, flags, args.threads, checkpoint)
            where = f" ({slots[i]})" if slots and i < len(slots) else ""
            status.say(
                f"{'resume' if checkpoint else 'start'} {env_id} seed {seed} in {args.dir}{where}: {shlex.join(cmd)}"
            )
        return
    stop = []  # the signal that stops the sweep, once one arrives
    handlers = {s: signal.signal(s, lambda signum, frame: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    running, failed, done, free, placed, mps = {}, [], 0, list(range(len(slots or []))), {}, {}
    try:
        if slots and args.mps and args.runs_per_gpu > 1:  # MPS only pays where runs share a GPU
            mps = start_mps(gpus, args.dir, status.say)
        if slots and args.runs_per_gpu > 1 and not mps and "Exclusive_Process" in (nvidia_smi(*COMPUTE_MODE) or ""):
            status.say(
                "a GPU is in compute mode Exclusive_Process: it takes one process, so one run unless MPS serves it"
            )
        while (todo and not stop) or running:
            while todo and not stop and len(running) < workers:
                env_id, seed, checkpoint = todo.pop(0)
                place = slots[free.pop(0)] if slots else None
                running[env_id, seed] = start_run(
                    args.script, env_id, seed, flags, args.threads, args.dir, args.logs, checkpoint, place, mps
                )
                if place:
                    status.say(f"start  {env_id} seed {seed} on {place}")
                    placed.setdefault(place.gpu.name, []).append(f"{env_id} seed {seed}")
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
                where = f" ({process.place})" if process.place else ""
                if process.place:
                    free = sorted([*free, slots.index(process.place)])
                if process.returncode == 0:
                    done += 1
                    status.say(f"done   {env_id} seed {seed}{where}")
                elif getattr(process, "signalled", False):
                    status.say(
                        f"stopped {env_id} seed {seed}{where}: checkpoint written, resumed when the sweep runs again"
                    )
                else:
                    failed.append((env_id, seed))
                    status.say(f"FAILED {env_id} seed {seed}{where} (exit {process.returncode}, log {log})")
            status.update(done, len(failed), running)
            time.sleep(0.2)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        stop_mps(mps, status.say)
    if status.tty:
        print()
    for gpu, names in placed.items():  # the summary: which GPU each run had
        print(f"GPU {gpu}: {', '.join(names)}", flush=True)
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


def task_size(args):
    """Runs per array task: one, or with --runs-per-gpu N that many on each of the task's GPUs (N without a GPU)."""
    return 1 if args.runs_per_gpu is None else args.runs_per_gpu * max(args.gpus, 1)


def slurm_job(args, flags, runs):
    """The sbatch script of the job array: task i runs its runs (one, or task_size's) through this file in local mode,
    with --runs-per-gpu as many at once on its GPU, each pinned to its share of the task's cores."""
    exp_name = exp_name_of(args.script, flags)
    logs = Path(args.logs).resolve()
    size = task_size(args)
    tasks = [runs[i : i + size] for i in range(0, len(runs), size)]
    directives = [
        f"--job-name={exp_name}",
        f"--array=0-{len(tasks) - 1}%{args.max_parallel}" if args.max_parallel else f"--array=0-{len(tasks) - 1}",
        f"--time={args.time}",
        f"--cpus-per-task={args.cpus_per_task}",
        f"--mem={args.mem}",
        f"--output={logs}/slurm-%A_%a.out",
        f"--signal={'TERM' if args.runs_per_gpu is None else 'B:TERM'}@{args.signal_before}",
    ]  # SIGTERM before the limit: the runs checkpoint (with --runs-per-gpu, through the sweep alone, which stops its
    # MPS daemons only once its runs are done)
    directives += [f"--gres=gpu:{args.gpus}"] if args.gpus else []
    directives += [f"--partition={args.partition}"] if args.partition else []
    directives += ["--requeue"] if args.requeue else []
    directives += args.sbatch_arg
    lines = ["#!/usr/bin/env bash"] + [f"#SBATCH {d}" for d in directives]
    per_task = ["--workers", "1", "--threads", str(args.cpus_per_task)]
    if args.runs_per_gpu is not None:  # a task without a GPU sees none, even on a node that has some
        per_task = ["--runs-per-gpu", str(args.runs_per_gpu), "--threads", str(args.cpus_per_task // size)]
        per_task += [] if args.mps else ["--no-mps"]
        lines += [] if args.gpus else ["export CUDA_VISIBLE_DEVICES="]
    lines += [
        "TASKS=(" + " ".join(shlex.quote(" ".join(f"{e}@{s}" for e, s in task)) for task in tasks) + ")",
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
        f"{shlex.quote(args.script)} --task-runs ${{TASKS[$SLURM_ARRAY_TASK_ID]}} {' '.join(per_task)} --slurm-task "
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
    tasks = -(-len(todo) // task_size(args))
    print(
        f"submitted job array {job_id} ({tasks} tasks, {len(todo)} runs): {job_file}; logs in {args.logs}", flush=True
    )
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
        help="local runs at a time (default: the CPUs this process may use, divided by --threads; with GPUs, at "
        "most --runs-per-gpu on each)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument(
        "--dir",
        help="the sweep's directory, which holds its runs/ and logs/ (default: "
        "sweeps/{exp_name}); runs outside it are never skipped, resumed or reported with it",
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would run, and run nothing")
    gpu = parser.add_argument_group("GPUs (with --runs-per-gpu; without a GPU the sweep runs as without it)")
    gpu.add_argument(
        "--runs-per-gpu",
        type=int,
        help="runs at once on each GPU, each pinned to --threads cores of its own and shown only its GPU",
    )
    gpu.add_argument(
        "--gpu-ids",
        nargs="+",
        help="the GPUs it may use, as nvidia-smi -L numbers them or as CUDA_VISIBLE_DEVICES names them (default: "
        "every GPU it sees: CUDA_VISIBLE_DEVICES's, else nvidia-smi -L's)",
    )
    gpu.add_argument(
        "--no-mps",
        dest="mps",
        action="store_false",
        help="no MPS daemon: the runs on a GPU share it by time-slicing (by default, with two or more runs per GPU, "
        "the sweep starts an MPS control daemon per GPU when nvidia-cuda-mps-control is there and none answers)",
    )
    parser.add_argument("--logs", help="the runs' logs and Slurm's output (default: {dir}/logs)")
    slurm = parser.add_argument_group("Slurm (with --slurm)")
    slurm.add_argument("--slurm", action="store_true", help="submit the runs as a Slurm job array")
    slurm.add_argument("--time", default="24:00:00", help="time limit per run")
    slurm.add_argument(
        "--cpus-per-task",
        type=int,
        help="default 2; with --runs-per-gpu, --threads for each run the task holds",
    )
    slurm.add_argument("--mem", help="memory per task (default 8G for each run it holds)")
    slurm.add_argument(
        "--gpus",
        type=int,
        help="GPUs per task (--gres=gpu:N; default 0, with --runs-per-gpu 1: a task holds --runs-per-gpu runs on "
        "each; --gpus 0 asks for none, and its runs run on the CPU)",
    )
    slurm.add_argument("--partition")
    slurm.add_argument("--max-parallel", type=int, help="at most this many tasks at once (--array=...%%N)")
    slurm.add_argument("--signal-before", type=int, default=300, help="SIGTERM this many seconds before the limit")
    slurm.add_argument("--requeue", action="store_true", help="requeue pre-empted tasks (they resume)")
    slurm.add_argument("--wait", action="store_true", help="block until the array has finished; check the results")
    slurm.add_argument("--slurm-task", action="store_true", help=argparse.SUPPRESS)  # set in the job array's tasks
    slurm.add_argument("--task-runs", nargs="+", help=argparse.SUPPRESS)  # a task's runs, as ENV@SEED
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
    if args.runs_per_gpu is not None and args.runs_per_gpu < 1:
        parser.error("--runs-per-gpu must be positive")
    args.gpus = (0 if args.runs_per_gpu is None else 1) if args.gpus is None else args.gpus
    args.cpus_per_task = args.cpus_per_task or (2 if args.runs_per_gpu is None else task_size(args) * args.threads)
    args.mem = args.mem or f"{8 * task_size(args)}G"
    if args.slurm and args.cpus_per_task < task_size(args):
        parser.error(f"--cpus-per-task {args.cpus_per_task}: a task holds {task_size(args)} runs, a core each at least")
    names = args.envs or (["classic"] if Path(args.script).stem == "sac_discrete" else ["mujoco"])
    envs = [env for name in names for env in ENV_SETS.get(name, [name])]
    runs = [(env_id, seed) for env_id in envs for seed in args.seeds]
    if args.task_runs:  # a Slurm task's runs
        runs = [(env_id, int(seed)) for env_id, _, seed in (run.rpartition("@") for run in args.task_runs)]
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

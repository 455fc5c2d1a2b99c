"""Our scripts beside the codes users compare them with, timed from outside and alike for every program.

Each program runs the speed workload (Hopper-v4, batch 256, 1000 random steps, then --updates env steps with the
updates) at its own defaults otherwise. A `sitecustomize` put on its PYTHONPATH wraps gymnasium's
`SyncVectorEnv.step` and `TimeLimit.step` (which every MuJoCo env made by `gym.make` goes through) and notes when the
program's env steps reach 1, 1000, 1000 + updates/2 and 1000 + updates, counting a vector step as num_envs steps (a
reset step of gymnasium 1.x's default next-step autoreset too, as CleanRL's loop counts it), and the first step after
each episode's end; at the last mark it writes what it noted and ends the process (what a program does after its run,
an evaluation or saving, is not timed). So for every program alike:
- start-up: the seconds from the command to its first env step (imports, env, networks, buffer, device);
- steps/s steady: the env steps over the seconds of the second half of the updates (compilation and CUDA graph
  capture left out, as benchmark/speed.py's steady figure), and steps/s from the 1000th step (all of the updates);
  each counted from an episode's end to a later one's where the window holds two, since TD7 (ours and its authors')
  holds its updates back to an episode's end and then runs them at once: a window cut between marks would take in a
  burst more or less than the steps it counts;
- peak memory: the process's peak resident set; on a GPU torch's peak allocation.
Where a program steps several envs (an evaluation env beside the training env), the one that reaches the last
mark is timed; start-up is its first step of any env.

The anchors come from their own checkouts under --anchors DIR, which this project does not hold:
    git clone https://github.com/vwxyzjn/cleanrl DIR/cleanrl      # td3_continuous_action.py, sac_continuous_action.py
    git clone https://github.com/sfujim/TD7 DIR/TD7               # run through a gym-to-gymnasium adapter (below)
    git clone https://github.com/meta-pytorch/LeanRL DIR/LeanRL   # on a GPU only; needs tensordict and torchrl
A pair whose anchor is missing is skipped, saying so. Pairs: ours eager against CleanRL's (TD3, SAC) and the TD7
authors' code; on a GPU also ours with CUDA graphs (the default there) against LeanRL's compile+cudagraphs and the
TD7 authors' code. Each pair runs alternately, --repeats times; the table gives each program's median and range, and
ours over the anchor's medians.

--ops (on the CPU) counts instead, from the first env step on, every ATen op the program dispatches (a
TorchDispatchMode; the backward's too, which the CPU runs in the caller's thread), per env step over the steady
window: the proxy for the kernels that an eager step launches on a GPU, where each op is a launch. Counted apart:
the ops within optimizer steps (torch's global step hooks), the views outside them (no kernel), optimizer steps, and
`.item()` calls outside them (on a GPU each waits for the device). An optimizer left to choose its implementation
(CleanRL's and the TD7 authors' Adam) takes the foreach one that it takes on a GPU, not the CPU's for-loop; ours ask
for the fused one everywhere. Not counted, since the CPU makes none: the copies between host and device.

    python benchmark/anchors.py --anchors ~/anchors --devices cpu --updates 2000 --repeats 3
    python benchmark/anchors.py --anchors ~/anchors --ops --updates 2000 --repeats 1
    python benchmark/anchors.py --anchors .anchors --devices cuda --updates 1000 --repeats 1 --out OUT/anchors.md
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmark.speed import workload_flags, write  # noqa: E402

RANDOM_STEPS = 1000
ANCHOR_MODE = {"leanrl": "compile+cudagraphs"}  # (the others run eagerly)

# Loaded by the timed program at its start (through PYTHONPATH); ANCHOR_TIMING names the marks and the output file.
HOOK = """
import builtins, json, os, resource, sys, time
_marks, _out, _count_ops = json.loads(os.environ["ANCHOR_TIMING"])
_first, _counts, _times, _inside, _import, _wrapped = [], {}, {}, [], builtins.__import__, {}
_ends, _ended = {}, set()  # (steps, time, _ops) at the first step after an episode's end; the envs whose step ended one
_ops = dict.fromkeys(["ops", "in optimizer steps", "views", "optimizer steps", "item"], 0)  # (with _count_ops)


def _start_counting():  # the ATen ops dispatched from the first env step on (on the CPU the backward's too), by kind
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    def step_begins(*_):
        _ops["optimizer steps"] += 1
        _in_step.append(1)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace != "aten":  # (the profiler's marks that an optimizer's step makes)
                return func(*args, **(kwargs or {}))
            _ops["ops"] += 1
            _ops["in optimizer steps"] += bool(_in_step)
            _ops["views"] += func.is_view and not _in_step  # (a view launches no kernel on a GPU)
            _ops["item"] += func is torch.ops.aten._local_scalar_dense.default and not _in_step  # (a GPU's wait)
            return func(*args, **(kwargs or {}))

    for module in [module for name, module in sys.modules.items() if name.startswith("torch.optim.")]:
        if hasattr(module, "_default_to_fused_or_foreach"):  # an optimizer left to choose takes foreach, as on a GPU
            module._default_to_fused_or_foreach = lambda params, differentiable, use_fused=False: (False, True)
    _in_step = []
    register_optimizer_step_pre_hook(step_begins)
    register_optimizer_step_post_hook(lambda *_: _in_step.pop())
    Count().__enter__()


def _count(self, steps):
    now = time.time()
    _count_ops and not _first and _start_counting()
    _first or _first.append(now)
    before = _counts.get(id(self), 0)
    n = _counts[id(self)] = before + steps
    if id(self) in _ended:
        _ended.discard(id(self))
        _ends.setdefault(id(self), []).append((before, now, dict(_ops)))
    for mark in _marks:
        if before < mark <= n:
            _times.setdefault(id(self), {})[mark] = now, dict(_ops)
    if n >= _marks[-1]:
        torch = sys.modules.get("torch")
        cuda = torch is not None and torch.cuda.is_initialized()
        with open(_out, "w") as f:
            json.dump({"first": _first[0], "marks": _times[id(self)], "ends": _ends.get(id(self), []),
                       "pid": os.getpid(),
                       "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                       "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}, f)
        os._exit(0)


def _note_end(self, result):  # (terminated, truncated: an env's flags or a vector env's arrays)
    if sys.modules["numpy"].any(result[2]) or sys.modules["numpy"].any(result[3]):
        _ended.add(id(self))
    return result


def _env_step(self, *args, **kwargs):  # an env's step, counted unless a vector env's step counts it
    if _inside:
        return _wrapped["env"](self, *args, **kwargs)
    _count(self, 1)
    return _note_end(self, _wrapped["env"](self, *args, **kwargs))


def _vector_step(self, *args, **kwargs):  # num_envs steps (a reset step of the next-step autoreset counts too)
    _inside or _count(self, self.num_envs)
    _inside.append(1)
    try:
        return _note_end(self, _wrapped["vector"](self, *args, **kwargs))
    finally:
        _inside.pop()


def _hook(name, *args, **kwargs):  # wraps the steps as soon as gymnasium's wrappers and vector envs are imported
    module = _import(name, *args, **kwargs)
    wrappers, vector = sys.modules.get("gymnasium.wrappers"), sys.modules.get("gymnasium.vector")
    for key, module_, cls, step in (("env", wrappers, "TimeLimit", _env_step), ("vector", vector, "SyncVectorEnv",
                                                                              _vector_step)):
        if key not in _wrapped and module_ is not None and cls in vars(module_):
            _wrapped[key], getattr(module_, cls).step = getattr(module_, cls).step, step
    if len(_wrapped) == 2:
        builtins.__import__ = _import
    return module


builtins.__import__ = _hook
"""

# The old gym API (reset -> obs, step -> 4-tuple, seed) over gymnasium 1.x, for the TD7 authors' main.py.
GYM_ADAPTER = """
import gymnasium


class Env:
    def __init__(self, env_id):
        self.env = gymnasium.make(env_id)
        self.action_space, self.observation_space = self.env.action_space, self.env.observation_space
        self._max_episode_steps, self._seed = self.env.spec.max_episode_steps, None

    def seed(self, seed):
        self._seed = seed

    def reset(self):
        obs, self._seed = self.env.reset(seed=self._seed)[0], None
        return obs

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated or truncated, info


make = Env
"""


def anchor_command(name, anchors, device, updates, adapter):
    """(command, extra PYTHONPATH entries, extra environment) of an anchor, or a false value where its checkout (or
    for LeanRL, tensordict or torchrl) is missing; `adapter`: timing_folder's folder of the gym adapter and the
    stand-in wandb."""
    total, cleanrl, leanrl, td7 = RANDOM_STEPS + updates + 1, anchors / "cleanrl", anchors / "LeanRL", anchors / "TD7"
    common = ["--env-id", "Hopper-v4", "--learning-starts", str(RANDOM_STEPS), "--total-timesteps", str(total)]
    if name.startswith("cleanrl"):
        script = cleanrl / "cleanrl" / f"{name.split()[1]}_continuous_action.py"
        flags = common + ["--cuda" if device == "cuda" else "--no-cuda"]
        return script.exists() and ([sys.executable, str(script), *flags], [cleanrl], {})
    if name.startswith("leanrl"):
        if not all(importlib.util.find_spec(package) for package in ("tensordict", "torchrl")):
            return None
        script = leanrl / "leanrl" / f"{name.split()[1]}_continuous_action_torchcompile.py"
        flags = common + ["--compile", "--cudagraphs"]
        paths = [leanrl] + [adapter / "no_wandb"] * (importlib.util.find_spec("wandb") is None)
        return script.exists() and ([sys.executable, str(script), *flags], paths, {"WANDB_MODE": "disabled"})
    flags = ["--env", "Hopper-v4", "--timesteps_before_training", str(RANDOM_STEPS), "--max_timesteps", str(total)]
    flags += ["--eval_freq", str(10 * total), "--eval_eps", "1"]  # (it evaluates at step 0 whatever the frequency)
    hide_gpu = {} if device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}  # (it takes a GPU wherever there is one)
    return (td7 / "main.py").exists() and ([sys.executable, str(td7 / "main.py"), *flags], [td7, adapter], hide_gpu)


# For LeanRL where wandb is not installed (a GPU machine's python may lack it): it imports wandb whatever its flags
# say, and runs here with WANDB_MODE=disabled, so a wandb that does nothing changes nothing it computes or times.
NO_WANDB = """
def init(*args, **kwargs):
    pass


def log(*args, **kwargs):
    pass
"""


def versions(anchors):
    """Each anchor checkout's commit: its COMMIT file (gpu_check.sh get-anchors writes it), else git's HEAD."""
    found = {}
    for folder in sorted(path for path in anchors.iterdir() if path.is_dir()):
        commit, git = folder / "COMMIT", ["git", "-C", str(folder), "rev-parse", "HEAD"]
        if commit.exists():
            found[folder.name] = commit.read_text().strip()[:10]
        elif (folder / ".git").exists():
            found[folder.name] = subprocess.run(git, capture_output=True, text=True).stdout.strip()[:10] or "unknown"
        else:
            found[folder.name] = "unknown"
    return ", ".join(f"{name} {commit}" for name, commit in found.items())


def pairs(devices):
    """(device, our script, our mode, anchor) in the order they run."""
    for device in devices:
        yield from [
            (device, "td3_continuous.py", "eager", "cleanrl td3"),
            (device, "sac_continuous.py", "eager", "cleanrl sac"),
            (device, "td7_continuous.py", "eager", "td7 authors"),
        ]
        if device == "cuda":
            yield from [
                (device, "td3_continuous.py", "cudagraphs", "leanrl td3"),
                (device, "sac_continuous.py", "cudagraphs", "leanrl sac"),
                (device, "td7_continuous.py", "cudagraphs", "td7 authors"),
            ]


def timing_folder(workdir):
    """Write the hook (as sitecustomize.py) into `workdir` and the gym adapter into a folder there, the stand-in
    wandb into a folder in that; return the adapter's folder."""
    (Path(workdir) / "sitecustomize.py").write_text(HOOK)
    adapter = Path(workdir) / "adapter"
    (adapter / "no_wandb").mkdir(parents=True, exist_ok=True)
    (adapter / "gym.py").write_text(GYM_ADAPTER)
    (adapter / "no_wandb" / "wandb.py").write_text(NO_WANDB)
    return adapter


def measure(command, paths, env, updates, workdir, count_ops=False):
    """Run `command` in `workdir` (a timing_folder) under the hook; its figures (a dict), or the end of its output
    where it ended without them. With `count_ops` also its ATen ops per env step, by kind (the counting slows it)."""
    out = Path(workdir) / "times.json"
    out.unlink(missing_ok=True)
    marks = [1, RANDOM_STEPS, RANDOM_STEPS + updates // 2, RANDOM_STEPS + updates]
    pythonpath = [str(workdir), *map(str, paths), os.environ.get("PYTHONPATH", "")]
    environment = (
        os.environ
        | env
        | {
            "ANCHOR_TIMING": json.dumps([marks, str(out), count_ops]),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, pythonpath)),
        }
    )
    start = time.time()
    result = subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True)
    if not out.exists():
        return (result.stdout + result.stderr)[-3000:] or f"exit status {result.returncode}, no output"
    seen = json.loads(out.read_text())
    at_marks = {int(step): (step, *noted) for step, noted in seen["marks"].items()}

    def window(mark):  # (steps, time, ops) at its two ends: from `mark` to the last mark, or where two episodes' ends
        ends = [end for end in seen["ends"] if end[0] >= mark]  # fall within, from the first of them to the last
        return (ends[0], ends[-1]) if len(ends) >= 2 else (at_marks[mark], at_marks[marks[-1]])

    def rate(mark):  # env steps/s over its window
        (steps0, t0, _), (steps1, t1, _) = window(mark)
        return (steps1 - steps0) / (t1 - t0)

    figures = {
        "startup_s": seen["first"] - start,
        "steady_sps": rate(marks[2]),
        "sps": rate(marks[1]),
        "peak_rss_mib": seen["peak_rss_mib"],
        "peak_cuda_mib": seen["peak_cuda_mib"],
    }
    if count_ops:  # each kind's count per env step over the steady window
        (steps0, _, ops0), (steps1, _, ops1) = window(marks[2])
        figures["ops"] = {kind: (ops1[kind] - ops0[kind]) / (steps1 - steps0) for kind in ops1}
    return figures


def row(label, device, mode, runs, reference=None):
    """A table row of one program's runs: median (min-max) of each figure; with `reference`, ours over it."""

    def figure(key, digits=0):
        values = sorted(run[key] for run in runs)
        return f"{statistics.median(values):.{digits}f} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})"

    steady = statistics.median(run["steady_sps"] for run in runs)
    ratio = "" if reference is None else f"{steady / reference:.2f}"
    cuda = f"{max(run['peak_cuda_mib'] or 0 for run in runs):.0f}" if device == "cuda" else "-"
    return (
        f"| {label} | {device} | {mode} | {figure('startup_s', 1)} | {figure('steady_sps')} | {figure('sps')} | "
        f"{max(run['peak_rss_mib'] for run in runs):.0f} | {cuda} | {ratio} |\n"
    ), steady


def ops_row(label, runs, reference=None):
    """A row of --ops: each kind's median over the runs, per env step; with `reference`, ours over it in the ops less
    the views outside the optimizers' steps (the proxy for the kernels that an eager GPU step launches)."""
    kinds = {kind: statistics.median(run["ops"][kind] for run in runs) for kind in runs[0]["ops"]}
    launches = kinds["ops"] - kinds["views"]
    ratio = "" if reference is None else f"{launches / reference:.2f}"
    figures = " | ".join(f"{kinds[kind]:.{2 if kind in ('optimizer steps', 'item') else 1}f}" for kind in kinds)
    return f"| {label} | {figures} | {launches:.1f} | {ratio} |\n", launches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", type=Path, required=True, help="the folder of the anchors' checkouts")
    parser.add_argument("--devices", nargs="+", default=["cpu"], choices=["cpu", "cuda"])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each program, alternating within a pair")
    parser.add_argument("--only", nargs="+", help="the pairs whose anchor's name holds one of these words")
    parser.add_argument("--ops", action="store_true", help="count each program's ATen ops per env step instead")
    parser.add_argument("--out", default=str(REPO / "benchmark" / "results" / "anchors.md"))
    args = parser.parse_args(argv)
    args.anchors = args.anchors.expanduser().resolve()  # the programs run in a folder of their own
    import torch

    if "cuda" in args.devices and not torch.cuda.is_available():
        sys.exit("error: --devices cuda, but torch sees no CUDA GPU")
    if args.ops and args.devices != ["cpu"]:
        sys.exit("error: --ops counts on the CPU only (--devices cpu), where the backward's ops run in the caller")
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    machine = f"{torch.cuda.get_device_name()}, {cpu}" if "cuda" in args.devices else cpu
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    heading = (
        f"\n## {datetime.date.today()}: {os.cpu_count()} cores, {machine}, torch {torch.__version__}, "
        f"{args.updates} updates, {args.repeats} run{'s each, alternating' if args.repeats > 1 else ' each'} "
        f"(benchmark/anchors.py{' --ops' * args.ops}; "
        f"the anchors at {versions(args.anchors)})\n\n"
    )
    if args.ops:
        columns = "ATen ops | in optimizer steps | views (outside them) | optimizer steps | `.item()` (outside them) "
        columns += "| launches (ops less views) | ours / anchor (launches)"
        heading += f"Per env step over the steady window, eager on the CPU.\n\n| program | {columns} |\n"
        heading += "|---" * 8 + "|\n"
    else:
        heading += "| program | device | mode | start-up s | steps/s steady | steps/s from step 1000 | peak RSS (MiB) "
        heading += "| peak CUDA (MiB) | ours / anchor (steady) |\n" + "|---" * 9 + "|\n"
    write(args.out, heading)
    failed = []
    with tempfile.TemporaryDirectory() as workdir:
        adapter = timing_folder(workdir)
        for device, script, mode, anchor in pairs(args.devices):
            if args.only and not any(word in anchor for word in args.only):
                continue
            found = anchor_command(anchor, args.anchors, device, args.updates, adapter)
            if not found:
                print(f"skipped: {script} ({mode}) against {anchor}: its checkout or a package it needs is missing")
                continue
            command, paths, env = found
            ours = [sys.executable, str(REPO / script), *workload_flags(script, device, args.updates + 1, mode=mode)]
            programs = {"ours": (ours, [], {}), "anchor": (command, paths, env)}
            runs = {"ours": [], "anchor": []}
            for _ in range(args.repeats):
                for who, (command, paths, env) in programs.items():
                    result = measure(command, paths, env, args.updates, workdir, args.ops)
                    if isinstance(result, str):
                        failed.append(f"{who} of {script} ({mode}) / {anchor} on {device} failed:\n{result}")
                        print(failed[-1], file=sys.stderr, flush=True)
                    else:
                        runs[who].append(result)
            if runs["ours"] and runs["anchor"] and args.ops:
                text, reference = ops_row(anchor, runs["anchor"])
                write(args.out, ops_row(script, runs["ours"], reference)[0] + text)
            elif runs["ours"] and runs["anchor"]:
                text, reference = row(anchor, device, ANCHOR_MODE.get(anchor.split()[0], "eager"), runs["anchor"])
                write(args.out, row(script, device, mode, runs["ours"], reference)[0] + text)
    print(f"appended to {args.out}")
    if failed:
        sys.exit(f"{len(failed)} runs failed (their output above)")


if __name__ == "__main__":
    main()

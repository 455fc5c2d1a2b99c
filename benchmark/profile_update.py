"""Where the time of an update goes, how close to the arithmetic limit the scripts run, and how many ops an update
dispatches: for each script, on benchmark/speed.py's workload (Hopper-v4, CartPole-v1 for sac_discrete, batch 256,
1000 random steps, then one update per env step), with --torch-threads 1 unless told otherwise. By default, on the
CPU:

- the FLOPs of one env step once learning has started (its updates and the actor's forward for acting), counted by
  torch.utils.flop_counter on a short run;
- its steps/s without the profiler, and so the GFLOP/s it achieves, beside the core's own FP32 peak measured on a
  large matrix product with the same threads;
- a per-op profile (torch.profiler, self CPU time per env step) of a run, grouped: matrix products, the optimizer
  step, the other ops, and the rest of the step without the profiler: the time outside torch's ops (Python, the
  env, numpy). The profiler adds its own overhead to every op, so the ops' times are upper bounds and the rest a
  lower bound.

With --device cuda (eager: the question is why an eager GPU step is slow) the same, on the GPU: the FLOPs, steps/s
and the GPU's own FP32 peak (a 4096x4096 product); the profile adds the GPU's side (torch.profiler's CUDA activity):
the kernels' time per env step, so the share of the step in which the GPU computes at all (a step whose kernels take
a small share of it waits on the host: launches, Python, syncs), and the top kernels by GPU time.

--ops and --breakdown (all five scripts unless --scripts; --device cpu or cuda, --mode eager, compile, cudagraphs
or compile+cudagraphs) run the script's real main in-process under a Probe, which wraps the script's functions from
outside so that each call of them is a phase of the step: the env's step (gym's SyncVectorEnv.step, ERL's envs'
own), acting (from the policy's entry outside an update to the action's copy to the host, its noise included),
`upload`, the buffer's `add`, each update callable that `accelerate` returns, `Metrics.record` (the metrics and
their logging every --log-freq), and the rest; the evaluation and each update's first 4 calls (compile, a CUDA
graph's warm-up and capture, Adam's state) are left out. Every figure is the difference between a run of --updates
and one of 10, so that set-up and the random phase drop out, per env step of the learning phase:

- --ops: the ATen ops dispatched (counted by a TorchDispatchMode, the backward's included), in the updates and
  outside them by phase; per update in the callables (averaged over the updates: TD3's and ERL's actor, SAC's
  policy and TD7's actor step come every 2nd) and per call of each. It is the proxy for kernels per update that
  needs no GPU; tests/test_ops.py holds each script's count per update under a limit. On a GPU with --mode
  cudagraphs, also the nodes of each captured CUDA graph (through get_graph_data, or the CUDA runtime's
  cudaGraphGetNodes; "not available" where neither answers);
- --breakdown: the time of each phase, and its share of the step. On a GPU each phase begins and ends with
  torch.cuda.synchronize(), so that it holds its own kernels: that changes what is measured (the host no longer
  runs ahead of the GPU, so the step is slower than without the probe).

    python benchmark/profile_update.py --scripts td3_continuous.py sac_continuous.py td7_continuous.py --updates 1000
    python benchmark/profile_update.py --ops --updates 1000
    python benchmark/profile_update.py --breakdown --scripts td3_continuous.py td7_continuous.py --updates 1000
    python benchmark/profile_update.py --ops --breakdown --device cuda --mode cudagraphs --updates 1000
    python benchmark/profile_update.py --device cuda --scripts td3_continuous.py td7_continuous.py --updates 500

Each measurement runs in a process of its own; the markdown goes to stdout and is appended to --out when given.
"""

import argparse
import contextlib
import ctypes
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import gymnasium as gym
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmark.speed import MODE_FLAGS, WORKLOAD_ENV, load_script, workload_flags  # noqa: E402

GROUPS = {  # the ops' name prefixes of each group; the rest are "other ops"
    "matrix products": ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"),
    "optimizer step": ("aten::_fused_adam", "Optimizer."),  # the fused kernel, and the step's and zero_grad's Python
}
# --ops and --breakdown wrap a script's functions from outside: each call of them is a phase of the step, and the
# phase entered first holds the time and the ops of everything called inside it until it returns. Acting begins
# where the script's policy is entered outside an update and ends as the action's copy to the host (Tensor.cpu)
# returns, its noise included; the updates are the callables that the script's `accelerate` returns, each under its
# update function's name; the final evaluation is left out of the step.
ACTING = {
    "td3_continuous": "Actor.forward",
    "sac_continuous": "Actor.sample",
    "sac_discrete": "Actor.forward",
    "td7_continuous": "act",
    "erl_td3": "population_forward",
}
OUTSIDE = ["env step", "acting", "upload", "buffer add", "metrics", "the rest"]  # the phases besides the updates
# The first calls of each update are its warm-up, left out of the step like the evaluation: --compile compiles in the
# first, --cudagraphs runs 3 eagerly and captures the 4th; Adam makes its state in the first.
WARMUP = 4


class Probe:
    """Within it, the calls of a script module's functions are timed by phase (and with count_ops their ATen ops
    counted), with the env steps taken and the updates made (the count the script passes to Metrics.record)."""

    def __init__(self, module, device="cpu", count_ops=False):
        self.module, self.sync, self.count_ops = module, device == "cuda", count_ops
        self.phase, self.started, self.patched, self.callables = None, 0.0, [], {}
        self.seconds, self.ops, self.calls, self.update_ops = Counter(), Counter(), Counter(), Counter()
        self.env_steps = self.updates = 0

    def begin(self, phase):
        """Enter `phase`, unless another is open (acting gives way: it ends at its copy or at the next phase)."""
        if self.phase == "acting":
            self.end()
        if self.phase is not None:
            return False
        if self.sync:  # so that the phase before has finished on the GPU, and this one's kernels are its own
            torch.cuda.synchronize()
        self.calls[phase] += 1
        if phase in self.callables and self.calls[phase] <= WARMUP:
            phase = "warm-up"
        self.phase, self.started = phase, time.perf_counter()
        return True

    def end(self):
        if self.sync:
            torch.cuda.synchronize()
        self.seconds[self.phase] += time.perf_counter() - self.started
        self.phase = None

    def wrap(self, phase, fn, on_call=None):
        """`fn` as a call of `phase` when entered outside any other, calling on_call(*args) then."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.begin(phase):
                return fn(*args, **kwargs)
            try:
                if on_call:
                    on_call(*args)
                return fn(*args, **kwargs)
            finally:
                self.end()

        return wrapper

    def patch(self, owner, name, new):
        self.patched.append((owner, name, name in vars(owner), getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self):
        module, probe = self.module, self
        owner, _, name = ACTING[module.__name__].rpartition(".")
        owner = getattr(module, owner) if owner else module
        acting, copy = getattr(owner, name), torch.Tensor.cpu
        accelerate, make_env, vector_step = module.accelerate, module.make_env, gym.vector.SyncVectorEnv.step

        def act(*args, **kwargs):  # acting stays open when this returns: the action's noise and copy follow
            probe.begin("acting")
            return acting(*args, **kwargs)

        def cpu(tensor, *args, **kwargs):
            result = copy(tensor, *args, **kwargs)
            if probe.phase == "acting":
                probe.end()
            return result

        def accelerated(step, args):
            name = getattr(step, "func", step).__name__  # (the function of the partial)
            name = f"{name}[{len(probe.callables)}]" if name in probe.callables else name
            probe.callables[name] = accelerate(step, args)
            return probe.wrap(name, probe.callables[name])

        def made_env(*args, **kwargs):  # a single env (ERL's), not a vector env's factory: its own step is timed
            env = make_env(*args, **kwargs)
            if isinstance(env, gym.Env):
                env.step = probe.wrap("env step", env.step, lambda *_: probe.count_steps(1))
            return env

        self.patch(owner, name, act)
        self.patch(torch.Tensor, "cpu", cpu)
        self.patch(module, "accelerate", accelerated)
        self.patch(module, "make_env", made_env)
        self.patch(gym.vector.SyncVectorEnv, "step", self.wrap("env step", vector_step, self.count_vector_steps))
        self.patch(module, "upload", self.wrap("upload", module.upload))
        for buffer in [c for n, c in vars(module).items() if n.endswith("Buffer") and hasattr(c, "add")]:
            self.patch(buffer, "add", self.wrap("buffer add", buffer.add))
        self.patch(module.Metrics, "record", self.wrap("metrics", module.Metrics.record, self.count_updates))
        self.patch(module.Run, "evaluate_and_log", self.wrap("evaluation", module.Run.evaluate_and_log))
        if self.sync and self.count_ops and keeps_graphs():  # the captured graphs kept, their nodes to be counted
            self.patch(torch.cuda, "CUDAGraph", functools.partial(torch.cuda.CUDAGraph, keep_graph=True))
        self.counter = OpCounter(self).__enter__() if self.count_ops else None
        return self

    def __exit__(self, *exc):
        if self.counter:
            self.counter.__exit__(*exc)
        for owner, name, own, old in reversed(self.patched):
            setattr(owner, name, old) if own else delattr(owner, name)

    def count_steps(self, steps):
        self.env_steps += steps

    def count_vector_steps(self, envs, *args):
        self.env_steps += envs.num_envs

    def count_updates(self, metrics, global_step, update, **values):
        self.updates = max(self.updates, update)

    def totals(self):
        """What the probe has seen, as plain numbers; the nodes of each captured CUDA graph where they can be read."""
        graphs = {
            name: graph_nodes(c.graph)
            for name, c in self.callables.items()
            if isinstance(getattr(c, "graph", None), torch.cuda.CUDAGraph)
        }
        return {
            "seconds": dict(self.seconds),
            "ops": dict(self.ops),
            "calls": dict(self.calls),
            "update_ops": dict(self.update_ops),
            "env_steps": self.env_steps,
            "updates": self.updates,
            "callables": list(self.callables),
            "graph_nodes": graphs,
        }


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched (the backward's too) into the probe's current phase, and by op in the updates."""

    def __init__(self, probe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":  # (not the profiler's record_function markers)
            phase = self.probe.phase or "the rest"
            self.probe.ops[phase] += 1
            if phase in self.probe.callables:
                self.probe.update_ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def keeps_graphs():
    """Whether this torch's CUDAGraph can keep its cudaGraph_t after capture (keep_graph, torch 2.7 and later)."""
    with contextlib.suppress(TypeError, ValueError):
        return "keep_graph" in inspect.signature(torch.cuda.CUDAGraph).parameters
    return False


def graph_nodes(graph):
    """The nodes of a captured torch.cuda.CUDAGraph (kept with keep_graph=True), or None where torch gives no way:
    its get_graph_data (newer torch, with the cuda-bindings package), else cudaGraphGetNodes from the CUDA runtime
    that torch has loaded, on raw_cuda_graph()."""
    with contextlib.suppress(Exception):
        return len(graph.get_graph_data()["nodes"])
    with contextlib.suppress(Exception):
        with open("/proc/self/maps") as maps:
            cudart = ctypes.CDLL(next(line.split()[-1] for line in maps if "libcudart" in line))
        count = ctypes.c_size_t(0)
        if cudart.cudaGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(count)) == 0:
            return count.value
    return None


def probe_run(script, flags, device="cpu", count_ops=False):
    """Run `script`'s main on `flags` in this process, in a directory of its own (two runs of a second would clash),
    under a Probe; its totals, with main's own seconds."""
    import tyro

    module = load_script(script)
    args = tyro.cli(module.Args, args=flags)
    threads, cwd = torch.get_num_threads(), os.getcwd()  # --torch-threads is process-wide
    try:
        os.chdir(tempfile.mkdtemp(dir=cwd))
        with Probe(module, device, count_ops) as probe:
            start = time.perf_counter()
            module.main(args)
            probe.seconds["main"] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
        os.chdir(cwd)
    return probe.totals()


def difference(short, long):
    """Per env step of the learning phase, from the totals of a short and a long run of the same workload (their
    set-up, random phase and anything else they share drop out): seconds and ATen ops by phase (the updates as one,
    and each callable), the updates per env step, and per update the ATen ops (and CUDA graph nodes) in the
    callables. Each callable counts at the cost of its calls after the warm-up, per call; the step's time is main's
    less the evaluation's and the warm-up calls'; the rest is what no phase holds."""
    steps, updates = long["env_steps"] - short["env_steps"], long["updates"] - short["updates"]
    if steps <= 0:
        raise ValueError("the two runs took the same env steps: give more updates (ERL runs whole generations)")

    def delta(kind, name):
        return long[kind].get(name, 0) - short[kind].get(name, 0)

    callables = long["callables"]
    calls = {name: delta("calls", name) for name in callables}
    steady = {
        name: max(long["calls"].get(name, 0) - WARMUP, 0) - max(short["calls"].get(name, 0) - WARMUP, 0)
        for name in callables
    }
    per_call = {
        kind: {name: delta(kind, name) / max(steady[name], 1) for name in callables} for kind in ("seconds", "ops")
    }
    seconds = {name: delta("seconds", name) / steps for name in OUTSIDE[:-1]}
    step = (delta("seconds", "main") - delta("seconds", "evaluation") - delta("seconds", "warm-up")) / steps
    seconds["the rest"] = step - sum(seconds.values()) - sum(delta("seconds", name) for name in callables) / steps
    ops = {name: delta("ops", name) / steps for name in OUTSIDE}
    for kind, figures in (("seconds", seconds), ("ops", ops)):
        figures.update({name: per_call[kind][name] * calls[name] / steps for name in callables})
        figures["updates"] = sum(figures[name] for name in callables)
    nodes = long["graph_nodes"]
    return {
        "env_steps": steps,
        "updates_per_step": updates / steps,
        "seconds": seconds,
        "ops": ops,
        "ops_per_update": ops["updates"] * steps / max(updates, 1),
        "ops_per_call": per_call["ops"],
        "seconds_per_call": per_call["seconds"],
        "top_update_ops": sorted(
            ((op, (n - short["update_ops"].get(op, 0)) / max(updates, 1)) for op, n in long["update_ops"].items()),
            key=lambda item: -item[1],
        ),
        "graph_nodes": nodes,
        "graph_nodes_per_update": None
        if not nodes or None in nodes.values()
        else sum(nodes[name] * calls[name] for name in nodes) / max(updates, 1),
    }


def peak_gflops(size=2048, repeats=10, device="cpu"):
    """The FP32 GFLOP/s of a large matrix product with torch's current threads (on a GPU: 4096, on the GPU): the
    device's practical peak."""
    import torch

    size = 4096 if device == "cuda" else size
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    torch.cuda.synchronize() if device == "cuda" else None
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize() if device == "cuda" else None
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def run_script(script, updates, threads, wrap, device="cpu"):
    """Run the workload of `script` in this process (eager), inside the context manager `wrap`; returns seconds."""
    import tyro

    module = load_script(script)
    args = tyro.cli(module.Args, args=workload_flags(script, device, updates, threads))
    start = time.perf_counter()
    with wrap:
        module.main(args)
    return time.perf_counter() - start


def child(script, updates, threads, flop_updates, device="cpu", base_updates=10):
    """One script's measurements, as one JSON line. Each is the difference between a run of `updates` and one of
    `base_updates`, so that setup, the random phase and the final evaluation drop out."""
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    run_script(script, flop_updates, threads, counter, device)
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (device == "cuda")
    measured = {}
    for n in (base_updates, updates):
        profiler = torch.profiler.profile(activities=activities)
        plain = run_script(script, n, threads, contextlib.nullcontext(), device)
        profiled = run_script(script, n, threads, profiler, device)
        events = profiler.key_averages()
        ops = {e.key: e.self_cpu_time_total / 1e6 for e in events if e.self_cpu_time_total}
        gpu = torch.autograd.DeviceType.CUDA  # the kernels' own events (an op's device time is its kernels' again)
        kernels = {e.key: e.self_device_time_total / 1e6 for e in events if e.device_type == gpu}
        measured[n] = plain, profiled, ops, kernels
    (plain0, profiled0, ops0, kernels0), (plain1, profiled1, ops1, kernels1) = measured[base_updates], measured[updates]
    steps = updates - base_updates
    print(
        json.dumps(
            {
                "flops_per_step": counter.get_total_flops() / flop_updates,
                "seconds_per_step": (plain1 - plain0) / steps,
                "profiled_seconds_per_step": (profiled1 - profiled0) / steps,
                "ops": {name: (seconds - ops0.get(name, 0.0)) / steps for name, seconds in ops1.items()},
                "kernels": {name: (seconds - kernels0.get(name, 0.0)) / steps for name, seconds in kernels1.items()},
                "peak_gflops": peak_gflops(device=device),
                "device": device,
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
    peak = "the GPU's" if m.get("device") == "cuda" else "the core's"
    kernels = sorted(m.get("kernels", {}).items(), key=lambda item: -item[1])
    gpu_busy = sum(seconds for _, seconds in kernels)
    lines = [
        f"### {script}",
        "",
        f"- FLOPs per env step once learning has started: {m['flops_per_step'] / 1e6:.0f} MFLOP",
        f"- Without the profiler: {1e3 * m['seconds_per_step']:.2f} ms per step ({1 / m['seconds_per_step']:.0f} "
        f"steps/s), {achieved:.1f} GFLOP/s, against {peak} {m['peak_gflops']:.0f} GFLOP/s on a large "
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
    if m.get("device") == "cuda":
        lines += [
            f"On the GPU: its kernels take {1e3 * gpu_busy:.2f} ms per step (profiled), {gpu_busy / total:.0%} of "
            f"the step without the profiler; the rest of the step the GPU waits on the host. Top {top} kernels by GPU "
            "time:",
            "",
            "| kernel | ms per step | share of the step |",
            "|---|---|---|",
            *[f"| `{name[:90]}` | {1e3 * s:.3f} | {s / total:.1%} |" for name, s in kernels[:top]],
            "",
        ]
    return "\n".join(lines) + "\n"


def child_phases(script, updates, threads, device, mode, count_ops, base_updates=10):
    """--ops (count_ops) or --breakdown: the difference of a run of `updates` and one of `base_updates` under a
    Probe, as one JSON line; after a first short run that is left out (the process's first run pays its imports and
    first calls)."""
    flags = [workload_flags(script, device, n, threads, mode) for n in (base_updates, base_updates, updates)]
    print(json.dumps(difference(*[probe_run(script, f, device, count_ops) for f in flags][1:])))


def ops_table(results, device, top):
    """--ops as markdown: ATen ops per env step, in the updates and outside them; per update in the callables."""
    graphs = device == "cuda"
    lines = [
        "| script | ATen ops per env step | in the updates | outside them | outside: env step, acting, upload, buffer "
        "add, metrics, the rest | updates per env step | ATen ops per update, in the callables (per call of each) |"
        + (" CUDA graph nodes per update (per graph) |" if graphs else ""),
        "|---" * (8 if graphs else 7) + "|",
    ]
    for script, m in results.items():
        ops, calls = m["ops"], ", ".join(f"{name} {n:.0f}" for name, n in m["ops_per_call"].items())
        outside = sum(ops[name] for name in OUTSIDE)
        row = f"| {script} | {ops['updates'] + outside:.1f} | {ops['updates']:.1f} | {outside:.1f} | "
        row += " / ".join(f"{ops[name]:.1f}" for name in OUTSIDE) + f" | {m['updates_per_step']:.2f} | "
        row += f"{m['ops_per_update']:.1f} ({calls}) |"
        if graphs:
            nodes = ", ".join(f"{name} {'not available' if n is None else n}" for name, n in m["graph_nodes"].items())
            per_update = m["graph_nodes_per_update"]
            if not nodes:
                row += " no graph captured (--mode eager or compile) |"
            else:
                row += f" {'not available' if per_update is None else f'{per_update:.0f}'} ({nodes}) |"
        lines.append(row)
    lines += ["", f"The {top} most frequent ATen ops in the updates, per update:", ""]
    for script, m in results.items():
        lines.append(f"- {script}: " + ", ".join(f"`{op}` {n:.1f}" for op, n in m["top_update_ops"][:top]))
    return "\n".join(lines) + "\n"


def breakdown_table(results):
    """--breakdown as markdown: ms per env step of each phase, and its share of the step."""
    phases = ["env step", "acting", "upload", "buffer add", "updates", "metrics", "the rest"]
    lines = [
        "| script | ms per env step | env step | acting and its copy to the host | upload | buffer add | updates | "
        "metrics | the rest | ms per call of each update |",
        "|---" * 10 + "|",
    ]
    for script, m in results.items():
        seconds = m["seconds"]
        total = sum(seconds[name] for name in phases)
        cells = [f"{1e3 * seconds[name]:.3f} ({seconds[name] / total:.0%})" for name in phases]
        calls = ", ".join(f"{name} {1e3 * s:.3f}" for name, s in m["seconds_per_call"].items())
        lines.append(f"| {script} | {1e3 * total:.3f} | " + " | ".join(cells) + f" | {calls} |")
    return "\n".join(lines) + "\n"


def phases(args):
    """--ops and/or --breakdown for each script, each measurement in a process of its own; returns the markdown."""
    where = f"--device {args.device}, --mode {args.mode}, --threads {args.threads}, torch {torch.__version__}"
    text = ""
    for kind, wanted in (("ops", args.ops), ("breakdown", args.breakdown)):
        if not wanted:
            continue
        results = {}
        for script in args.scripts or list(WORKLOAD_ENV):
            command = [sys.executable, __file__, "--child", script, "--updates", str(args.updates)]
            command += ["--threads", str(args.threads), "--device", args.device, "--mode", args.mode]
            command += ["--ops"] if kind == "ops" else ["--breakdown"]
            out = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.mkdtemp())
            if out.returncode:
                sys.exit(f"{script} failed:\n{out.stderr[-3000:]}")
            results[script] = json.loads(out.stdout.strip().splitlines()[-1])
        if kind == "ops":
            text += f"\n## ATen ops per env step: {args.updates} updates against 10, {where}\n\n"
            text += ops_table(results, args.device, args.top)
        else:
            sync = (
                "Each phase begins and ends with torch.cuda.synchronize(), so that it holds its own kernels; that "
                "changes what is measured: the host no longer runs ahead of the GPU, the step is slower than without "
                "the probe, and the shares are of this synchronised step."
                if args.device == "cuda"
                else "On the CPU nothing runs asynchronously, so no synchronisation is needed."
            )
            text += f"\n## One env step by phase: {args.updates} updates against 10, {where}\n\n"
            text += f"Each phase is the time inside the script's functions, wrapped from outside. {sync}\n\n"
            text += breakdown_table(results)
        print(text, flush=True)
    return text


def profile(args):
    """The FLOPs and the per-op profile of each script, each in a process of its own; returns the markdown."""
    text = f"\n## Profile: {args.updates} updates, --torch-threads {args.threads}, {args.device} (eager)\n\n"
    for script in args.scripts or ["td3_continuous.py", "sac_continuous.py", "td7_continuous.py"]:
        command = [sys.executable, __file__, "--child", script, "--updates", str(args.updates), "--device", args.device]
        command += ["--threads", str(args.threads), "--flop-updates", str(args.flop_updates)]
        out = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.mkdtemp())
        if out.returncode:
            sys.exit(f"{script} failed:\n{out.stderr[-3000:]}")
        section = report(script, json.loads(out.stdout.strip().splitlines()[-1]), args.top)
        print(section, flush=True)
        text += section
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", help="default: td3, sac and td7; all five with --ops or --breakdown")
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--flop-updates", type=int, default=100, help="the short run that counts FLOPs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--ops", action="store_true", help="ATen ops per env step, in the updates and outside them")
    parser.add_argument("--breakdown", action="store_true", help="the time of one env step by phase")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mode", choices=list(MODE_FLAGS), default="eager", help="for --ops and --breakdown")
    parser.add_argument("--out", help="a markdown file to append to")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and (args.ops or args.breakdown):
        return child_phases(args.child, args.updates, args.threads, args.device, args.mode, args.ops)
    if args.child:
        torch.set_num_threads(args.threads)  # for the peak, as --torch-threads sets it for the runs
        return child(args.child, args.updates, args.threads, args.flop_updates, args.device)
    text = phases(args) if args.ops or args.breakdown else profile(args)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

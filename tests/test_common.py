"""What every script must do the same way: outputs, resume, determinism, signals, the NaN guard, truncation
handling, progress, wandb and video. Parametrised over the scripts (bad input: tests/test_bad_input.py)."""

import csv
import fcntl
import importlib
import inspect
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import (
    DEFAULT_ENV,
    ERL_SMALL,
    REPO,
    SCRIPTS,
    TINY,
    TWO_ENV_FLAGS,
    assert_same,
    cli_env,
    flags_with,
    load_checkpoint,
    logged_losses,
    run_cli,
    run_main,
    toy_env,
)

pytestmark = pytest.mark.parametrize("script", SCRIPTS)


def read_evaluations(run_dir):
    with open(Path(run_dir) / "evaluations.csv") as f:
        return list(csv.DictReader(f))


def test_smoke_outputs(script, tiny_runs):
    run_dir = tiny_runs(script)
    assert run_dir.name.startswith(f"{DEFAULT_ENV[script]}__{script}__1__")
    rows = read_evaluations(run_dir)
    steps = [int(r["global_step"]) for r in rows]
    if script == "erl_td3":  # it evaluates at the end of the generations that cross 200 and 400 steps
        assert steps[0] >= 200
        assert steps[-1] >= 400
        assert len(steps) <= 2
        assert steps == sorted(set(steps))
    else:
        assert steps == [200, 400]
    assert all(len(r["returns"].split()) == 2 for r in rows)
    assert json.loads((run_dir / "args.json").read_text())["device"] == "cpu"  # the device used, not --cuda's default
    assert (run_dir / "model.pt").exists()
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert load_checkpoint(run_dir)["global_step"] == steps[-1]


def straight_run(script, cwd, monkeypatch, **overrides):
    return run_main(script, flags_with(TINY, **overrides), cwd, monkeypatch)


def test_same_seed_same_numbers(script, tmp_path, monkeypatch):
    a = straight_run(script, tmp_path / "a", monkeypatch)
    b = straight_run(script, tmp_path / "b", monkeypatch)
    returns = [[row["returns"] for row in read_evaluations(run["run_dir"])] for run in (a, b)]
    assert returns[0] == returns[1]
    c = straight_run(script, tmp_path / "c", monkeypatch, seed=2)
    assert read_evaluations(a["run_dir"])[-1]["returns"] != read_evaluations(c["run_dir"])[-1]["returns"]


BREAK_ON_A_CRITIC_UPDATE = {"erl_td3": {"policy_frequency": 3}, "td7_continuous": {"policy_frequency": 4}}


def test_resume_continues_identically(script, tmp_path, monkeypatch):
    """400 steps straight == 300 steps (updates from step 199 on), then --resume for 100 more: networks,
    optimisers, replay buffer, RNGs, env states, evaluations and the logged losses, bit for bit. The first update
    after the break makes no actor update, so the actor loss it logs is the one carried over the break. (ERL: 1000
    then 2000 steps, so that its generations of about 550 steps on Hopper fall on both sides of the break; an actor
    update every third, so that its 1334 updates at the break are followed by a critic update alone; TD7 every
    fourth.)"""
    half_steps, steps = (1000, 2000) if script == "erl_td3" else (300, 400)
    # Evaluations every 100 steps: the half run's final one falls on the straight run's schedule.
    # Where the first update after the break is a critic update alone (asserted below; TD7's bursts end at 173).
    flags = {"eval_freq": 100, **BREAK_ON_A_CRITIC_UPDATE.get(script, {"learning_starts": 199})}
    straight = straight_run(script, tmp_path / "a", monkeypatch, total_timesteps=steps, **flags)
    half = straight_run(script, tmp_path / "b", monkeypatch, total_timesteps=half_steps, **flags)
    resumed = straight_run(
        script,
        tmp_path / "b",
        monkeypatch,
        total_timesteps=steps,
        resume=Path(half["run_dir"]) / "checkpoint.pt",
        **flags,
    )
    if script != "sac_discrete":  # (its policy is updated at every update)
        updates = load_checkpoint(half["run_dir"])["loop"]["num_updates"]
        first = updates + 1 if script == "td7_continuous" else updates  # TD7 counts the update before it asks
        every = flags.get("policy_frequency", importlib.import_module(script).Args().policy_frequency)
        assert first % every, "the first update after the break updates the actor too"
    assert logged_losses(straight["run_dir"]) == logged_losses(resumed["run_dir"])
    assert half["global_step"] < steps
    assert resumed["run_dir"] == half["run_dir"]
    assert resumed["global_step"] == straight["global_step"] >= steps
    a, b = load_checkpoint(straight["run_dir"]), load_checkpoint(resumed["run_dir"])
    for key in ("args", "run_name", "wall_time", "run"):  # these differ by design: the flags given, the times
        a.pop(key, None), b.pop(key, None)
    assert_same(a, b)
    assert read_evaluations(straight["run_dir"]) == [
        {**row, "wall_time_s": s["wall_time_s"]}
        for row, s in zip(read_evaluations(resumed["run_dir"]), read_evaluations(straight["run_dir"]))
    ]


@pytest.mark.parametrize("env_id,terminate_at", [("Counter-v0", None), ("CounterTerminates-v0", 4)])
def test_truncation_stores_true_final_obs(script, env_id, terminate_at, tmp_path, monkeypatch):
    """The counter env's observation is its step count: every stored next_obs must be obs + 1, also at the
    7-step time limit, and only a true termination is stored as terminal."""
    flags = flags_with(
        TINY, env_id=toy_env(script, env_id), total_timesteps=60, learning_starts=50, batch_size=16, checkpoint_freq=60
    ) + TWO_ENV_FLAGS.get(script, ["--num-envs", "2"])
    run = run_main(script, flags, tmp_path, monkeypatch)
    rb = load_checkpoint(run["run_dir"])["state"]["rb"]
    # Every script's vector replay is one tensor of rows [obs, action, reward, terminated, next_obs].
    obs, terminated, next_obs = rb["data"][:, 0], rb["data"][:, -2], rb["data"][:, -1]
    assert len(obs) == run["global_step"] >= 60
    assert torch.equal(next_obs, obs + 1)
    assert (next_obs == (terminate_at or 7)).any()  # episodes ended, and kept their real final observation
    expected_terminal = (next_obs == terminate_at).float() if terminate_at else torch.zeros_like(terminated)
    assert torch.equal(terminated, expected_terminal)


def test_nonfinite_loss_stops_naming_it_and_its_window(script, tmp_path, monkeypatch, capsys):
    """A loss that turns NaN from the 30th update on (here the first metric each update records, made NaN as it is
    recorded, so that training itself goes on unharmed) stops the run at the next log point with one line: the
    metric, the updates of its log window and their global steps, and the last checkpoint; nothing non-finite is
    logged. (Issue 35: a running sum between log points, so the line names a window, not an update. ERL logs at its
    generations' ends: there a window is a generation's updates.)"""
    module = importlib.import_module(script)
    record, steps, poisoned_name = module.Metrics.record, {}, []

    def poisoned(self, global_step, update, **metrics):
        steps[update] = global_step
        if update >= 30:
            poisoned_name[:] = [next(iter(metrics))]
            metrics[poisoned_name[0]] = metrics[poisoned_name[0]] * float("nan")
        return record(self, global_step, update, **metrics)

    monkeypatch.setattr(module.Metrics, "record", poisoned)
    log_freq = 20 if "log_freq" in module.Args.__dataclass_fields__ else None
    flags = flags_with(TINY, total_timesteps=2000, eval_freq=0, checkpoint_freq=210)
    flags = flags_with(flags, log_freq=log_freq) if log_freq else flags
    with pytest.raises(SystemExit) as exit_info:
        run_main(script, flags, tmp_path, monkeypatch)
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    pattern = r"error: non-finite (\S+) in updates (\d+)-(\d+), from global_step (\d+) to (\d+); stopping\. Last " + (
        r"checkpoint: (.+)"
    )
    match = re.fullmatch(pattern, lines[0])
    assert match, lines[0]
    name, first, last, first_step, last_step, checkpoint = match.groups()
    first, last, first_step, last_step = map(int, (first, last, first_step, last_step))
    assert name == poisoned_name[0]
    assert first <= 30 <= last and last == max(steps)  # stopped at the window's end
    assert last - first < (log_freq or last)
    assert (first_step, last_step) == (steps[first], steps[last])
    (run_dir,) = (tmp_path / "runs").iterdir()
    if log_freq or checkpoint != "none":  # (ERL's first checkpoint may come after its first generation's updates)
        assert checkpoint == str(run_dir / "checkpoint.pt")
        assert load_checkpoint(run_dir)["global_step"] < first_step
    assert all(np.isfinite(value) for points in logged_losses(run_dir).values() for _, value in points)


def test_no_mujoco_deprecation_noise(script, tmp_path):
    """MuJoCo 4 warns at each load of HalfCheetah-v4's model (at the start and at every evaluation) that its
    `settotalmass` is deprecated, and writes MUJOCO_LOG.TXT into the current directory: the scripts drop that warning
    at its source, so a run prints neither, and leaves no file. (sac_discrete refuses the env with one line.)"""
    flags = flags_with(TINY, env_id="HalfCheetah-v4", total_timesteps=300, eval_freq=150, eval_episodes=1)
    if script == "erl_td3":  # a generation of 2 individuals and the learner, not of 10 (27 s, not 63)
        flags = flags_with(flags, **ERL_SMALL)
    result = run_cli(script, flags, tmp_path)
    assert result.returncode == (1 if script == "sac_discrete" else 0), result.stderr
    assert "settotalmass" not in result.stdout + result.stderr
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


def test_track_wandb_offline(script, tmp_path):
    result = run_cli(script, flags_with(TINY, total_timesteps=250, eval_freq=0) + ["--track"], tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list((run_dir / "wandb").glob("offline-run-*/*.wandb"))


def egl_available():
    try:
        os.environ.setdefault("MUJOCO_GL", "egl")
        from mujoco.egl import GLContext

        GLContext(8, 8).free()
        return True
    except Exception:
        return False


def test_capture_video_writes_frames(script, tmp_path):
    if not egl_available() and not os.environ.get("CI"):
        pytest.skip("headless MuJoCo rendering needs Debian's libegl1 and libgl1 (.ci/run installs them)")
    env_id = "CartPole-v1" if script == "sac_discrete" else "InvertedPendulum-v4"
    flags = flags_with(TINY, env_id=env_id, total_timesteps=250, eval_freq=0, eval_episodes=1)
    result = run_cli(script, flags + ["--capture-video"], tmp_path)
    assert result.returncode == 0, result.stderr
    videos = list((tmp_path / "videos").glob("*/*.mp4"))
    assert videos, result.stderr
    import imageio.v2 as imageio

    frames = [frame for frame in imageio.get_reader(videos[0])]
    assert len(frames) > 1
    assert np.asarray(frames[0]).std() > 0  # real frames of a real scene, not blank


class Log:
    """A log file (not a terminal: a sweep's, Slurm's), which notes the fake clock's time of each write."""

    def __init__(self, clock):
        self.clock, self.writes = clock, []

    def write(self, text):
        self.writes.append((self.clock[0], text))
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def lines(self):
        """(time, line) for every line written, the time of the write that ended it."""
        lines, line = [], ""
        for time_, text in self.writes:
            for part in re.split("(\n)", text):
                if part == "\n":
                    lines.append((time_, line))
                    line = ""
                else:
                    line += part
        return lines


@pytest.fixture
def progress_in_a_log(monkeypatch):
    """A function that sends stdout to a Log and gives the script (time.monotonic) and tqdm one fake clock, from
    then until the test ends; it returns (the Log, the clock as a one-item list)."""
    threads = torch.get_num_threads()

    def start():
        clock = [1000.0]
        monkeypatch.setattr(time, "monotonic", lambda: clock[0])
        monkeypatch.setattr("tqdm.std.time", lambda: clock[0])
        log = Log(clock)
        monkeypatch.setattr(sys, "stdout", log)
        return log, clock

    yield start
    torch.set_num_threads(threads)


def advance(progress, clock, steps, seconds_per_step, updates_per_step, global_step, num_updates):
    """`steps` env steps at a given speed, the progress told after each; returns the new (global_step, num_updates)."""
    for _ in range(steps):
        clock[0] += seconds_per_step
        global_step, num_updates = global_step + 1, num_updates + updates_per_step
        progress.update(global_step, num_updates)
    return global_step, num_updates


def eta_seconds(line):
    """The seconds of a progress line's ETA (tqdm's [H:]MM:SS), or None for "ETA ?"."""
    eta = re.search(r"ETA ([\d:]+|\?)", line).group(1)
    return None if eta == "?" else sum(int(part) * 60**i for i, part in enumerate(reversed(eta.split(":"))))


def test_progress_in_a_log(script, progress_in_a_log):
    """Not a terminal (a log: a sweep, Slurm): no carriage returns, at most one progress line a minute, messages as
    lines of their own; "ETA ?" until the first update, then an ETA from the speed of the phase the run is now in
    (the updates' 10 steps/s, not the average with the random phase's 100 steps/s), and a postfix with the updates/s,
    the last evaluation and the threads. (Fake clocks: a run of 11 minutes in a moment.)"""
    log, clock = progress_in_a_log()
    module = importlib.import_module(script)
    total = 100_000
    torch.set_num_threads(1)  # as Run sets --torch-threads 1
    progress = module.Progress(module.Args(total_timesteps=total, torch_threads=1), 0, 0, "-")
    step, updates = advance(progress, clock, 8000, 0.01, 0, 0, 0)  # 80 s of random steps
    first_update = clock[0]
    step, updates = advance(progress, clock, 6000, 0.1, 1, step, updates)  # 600 s of updates
    progress.say("step 14000/100000 | eval return 1.0 +- 0.0", sys.stdout)
    lines = log.lines()
    progress.bar.close()  # as the run's end: at most one line more, the final state
    assert len(log.lines()) - len(lines) <= 1
    assert not any("\r" in text for _, text in log.writes), log.writes
    assert [line for _, line in lines if "eval return" in line] == ["step 14000/100000 | eval return 1.0 +- 0.0"]
    bars = [(time_, line) for time_, line in lines if "ETA" in line]
    assert 9 <= len(bars) <= 12, bars  # about one a minute in 680 s, none before the first minute
    assert all(b[0] - a[0] >= 60 - 1e-6 for a, b in zip(bars, bars[1:])), bars
    assert bars[0][0] >= 1060 - 1e-6
    assert all(" steps, ETA " in line for _, line in bars), bars  # tqdm's ", " before the postfix, no "[, ETA"
    for time_, line in bars:
        n = int(re.search(r"(\d+)/100000", line).group(1))
        if time_ < first_update:
            assert eta_seconds(line) is None, line
        else:
            assert eta_seconds(line) == pytest.approx((total - n) / 10, rel=0.05), line
    assert bars[-1][1].endswith("10 updates/s, last eval -, 1 thread"), bars[-1]


def test_progress_after_resume(script, tmp_path, monkeypatch, progress_in_a_log):
    """A resumed run's progress starts from the checkpoint's step, update count and last evaluation (Run passes them
    on), and its speeds and ETA count only this process's steps and updates, not the checkpoint's as if made in its
    first seconds."""
    module = importlib.import_module(script)
    half_steps, steps = (1000, 2000) if script == "erl_td3" else (300, 400)
    half = straight_run(script, tmp_path, monkeypatch, total_timesteps=half_steps, eval_freq=100)
    checkpoint = load_checkpoint(half["run_dir"])
    init, started = module.Progress.__init__, []

    def recording(self, *args, **kwargs):
        started.append(inspect.signature(init).bind(self, *args, **kwargs).arguments)
        init(self, *args, **kwargs)

    monkeypatch.setattr(module.Progress, "__init__", recording)
    resume = Path(half["run_dir"]) / "checkpoint.pt"
    straight_run(script, tmp_path, monkeypatch, total_timesteps=steps, eval_freq=0, resume=resume)
    (given,) = started
    last_eval = f"{half['eval_mean']:.1f} +- {half['eval_std']:.1f}"
    assert (given["global_step"], given["num_updates"], given["last_eval"]) == (
        checkpoint["loop"]["global_step"],
        checkpoint["loop"]["num_updates"],
        last_eval,
    )
    # The progress of a run resumed at step 50,000 after 40,000 updates: 10 steps and updates a second from here on.
    monkeypatch.setattr(module.Progress, "__init__", init)
    log, clock = progress_in_a_log()
    torch.set_num_threads(1)
    progress = module.Progress(module.Args(total_timesteps=100_000, torch_threads=1), 50_000, 40_000, last_eval)
    advance(progress, clock, 700, 0.1, 1, 50_000, 40_000)
    bars = [line for _, line in log.lines() if "ETA" in line]
    progress.bar.close()
    assert bars
    for line in bars:
        assert re.search(r"\b10(\.0+)? ?steps?/s, 10 updates/s, last eval " + re.escape(last_eval), line), line
        n = int(re.search(r"(\d+)/100000", line).group(1))
        assert eta_seconds(line) == pytest.approx((100_000 - n) / 10, rel=0.05), line


def test_threads_follow_what_other_processes_leave_idle(script, monkeypatch):
    """--torch-threads 0: a run starts with one thread, takes torch's default once two checks in a row find the CPUs
    idle, and fewer at once as other processes use them (a core a fifth used counts as busy); one where the system
    does not say."""
    module = importlib.import_module(script)
    # (time, CPU seconds other processes used of this process's 4 CPUs, CPUs): others use 0.1, 0.1, 2.0, then 2.9 of
    # them.
    readings = [(0, 0, 4), (10, 1, 4), (20, 2, 4), (30, 22, 4), (40, 51, 4), None]
    monkeypatch.setattr(module.Threads, "reading", lambda self: readings.pop(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # as torch's default on a 4-core machine
    try:
        rule = module.Threads()
        chosen = [torch.get_num_threads()]
        for _ in range(5):
            rule.choose()
            chosen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(threads)
    assert chosen == [1, 1, 4, 2, 1, 1]


def test_threads_where_the_system_does_not_say(script, monkeypatch, progress_in_a_log):
    """--torch-threads 0 without /proc/stat or an affinity (macOS): the run goes on with one thread (not torch's
    default of 4 here), its progress lines saying so."""
    log, clock = progress_in_a_log()
    module = importlib.import_module(script)
    monkeypatch.setattr(module.Threads, "reading", lambda self: None)
    torch.set_num_threads(4)
    progress = module.Progress(module.Args(total_timesteps=100_000, torch_threads=0), 0, 0, "-")
    advance(progress, clock, 3000, 0.1, 1, 0, 0)
    progress.bar.close()
    bars = [line for _, line in log.lines() if "ETA" in line]
    assert bars
    assert all(line.endswith("updates/s, last eval -, 1 thread") for line in bars), bars
    assert torch.get_num_threads() == 1


def test_threads_beside_busy_processes(script):
    """The rule's reading of the system, live: one busy process on each CPU this process may use leaves one thread
    (from as many threads as CPUs)."""
    module = importlib.import_module(script)
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: one thread either way")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    threads = torch.get_num_threads()
    try:
        time.sleep(0.5)  # the busy processes running
        rule = module.Threads()
        assert rule.last is not None  # Linux says: /proc/stat and the affinity
        torch.set_num_threads(cpus)
        time.sleep(1.0)
        rule.choose()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
        for process in busy:
            process.kill()
            process.wait()


def test_progress_in_a_log_file(script, tmp_path):
    """A run through the command line with its output to a pipe (as to a log file): no carriage return anywhere, the
    run's first line (on the CPU the updates run eagerly, --cudagraphs being for a GPU, and args.json says so too),
    one line per evaluation (those of evaluations.csv), no progress line in a run shorter than a minute (at most one
    a minute), and the closing line last."""
    started = time.monotonic()
    result = run_cli(script, flags_with(TINY, eval_freq=100), tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert lines[0] == f"run {run_dir}: {DEFAULT_ENV[script]}, 400 steps on cpu, updates eager"
    assert json.loads((run_dir / "args.json").read_text())["cudagraphs"] is False
    evaluations = [line for line in lines if " | eval return " in line]
    assert [line.split("/")[0] for line in evaluations] == [
        f"step {r['global_step']}" for r in read_evaluations(run_dir)
    ]
    assert len([line for line in lines if "ETA" in line]) <= elapsed // 60, lines
    assert re.fullmatch(
        rf"finished 400 steps in \d+:\d\d:\d\d: final eval .+ \+- .+; {re.escape(str(run_dir))}", lines[-1]
    )


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_a_terminal(script, flags, cwd, columns=80, timeout=600):
    """Run a script through its command line with stdout and stderr on a pseudo-terminal of `columns` columns;
    returns its exit status and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {name: value for name, value in cli_env().items() if name not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / f"{script}.py"), *flags], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: every end of the terminal closed, the run gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    return proc.returncode, out.decode(errors="replace")


def test_progress_on_a_terminal(script, tmp_path):
    """On a terminal of 80 columns the progress bar is redrawn in place and every line of it fits the width (a wider
    one would wrap, and each redraw would add a line); the evaluations' lines come above it, each a line of its own,
    and the run ends with its closing line. (The run's own lines, which name its directory, may be wider: they are
    written once and wrap as any text does.)"""
    flags = flags_with(TINY, total_timesteps=1500, eval_freq=500, eval_episodes=1, checkpoint_freq=0)
    status, out = run_on_a_terminal(script, flags, tmp_path)
    assert status == 0, out
    (run_dir,) = (tmp_path / "runs").iterdir()
    parts = [part for part in re.split(r"[\r\n]", ANSI.sub("", out)) if part.strip()]
    own = re.compile(r"(run |resumed |finished |step \d+/1500 \| eval return )")
    bars = [part for part in parts if not own.match(part)]
    assert len([part for part in bars if "ETA" in part]) >= 2, out  # drawn, and redrawn
    assert all(len(part) <= 80 for part in bars), [part for part in bars if len(part) > 80]
    evaluations = [part for part in parts if own.match(part) and "eval return" in part]
    assert [part.split("/")[0] for part in evaluations] == [
        f"step {r['global_step']}" for r in read_evaluations(run_dir)
    ]
    assert all(re.fullmatch(r"step \d+/1500 \| eval return \S+ \+- \S+", part) for part in evaluations), evaluations
    assert re.fullmatch(rf"finished 1500 steps in \d+:\d\d:\d\d: final eval .+; {re.escape(str(run_dir))}", parts[-1])

"""What every script must do the same way: outputs, resume, determinism, signals, the NaN guard, truncation
handling, progress, wandb and video. Parametrised over the scripts (bad input: tests/test_bad_input.py)."""

import csv
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import (
    DEFAULT_ENV,
    SCRIPTS,
    TINY,
    TWO_ENV_FLAGS,
    assert_same,
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


def test_nonfinite_loss_stops_with_step(script, tmp_path):
    log_freq = {} if script == "erl_td3" else {"log_freq": 20}  # ERL checks at each generation's end
    flags = flags_with(
        TINY,
        env_id=toy_env(script, "CounterInfReward-v0"),
        total_timesteps=2000,
        learning_starts=100,
        checkpoint_freq=0,
        **log_freq,
    )
    result = run_cli(script, flags, tmp_path, timeout=300)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: non-finite"), result.stderr
    assert "global_step " in line, result.stderr
    # The reward turns infinite at the 300th step of the counter envs, evaluation episodes (14 steps at 200) included.
    evaluation = 28 if script == "erl_td3" else 14  # ERL evaluates the champion and a learner
    assert 300 - evaluation <= int(line.split("global_step ")[1].split(";")[0]) < 2000


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


def fake_clock(module, monkeypatch):
    """A clock that moves 7 s at each reading, so that a tiny run looks like a long one to the progress display."""
    clock = itertools.count(start=1.8e9, step=7.0)
    monkeypatch.setattr(module.time, "time", lambda: next(clock))


def test_progress_in_a_log(script, tmp_path, monkeypatch, capsys):
    """Not a terminal (a log, Slurm): plain progress lines with the step, env steps/s, updates/s, the last evaluation
    and the ETA, also during the random phase."""
    fake_clock(importlib.import_module(script), monkeypatch)
    run_main(script, flags_with(TINY, eval_freq=0), tmp_path, monkeypatch)
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps/s" in line]
    pattern = (
        r"step (\d+)/400 \(\d+%\) \| \d+ steps/s \| (\d+) updates/s \| last eval - \| ETA (\d+:\d\d:\d\d|-) \| 1 thread"
    )
    assert lines
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    if script != "erl_td3":  # ERL reports at its generations' ends and has no random phase
        assert min(int(re.fullmatch(pattern, line).group(1)) for line in lines) <= 200  # before learning starts


def test_threads_follow_what_other_processes_leave_idle(script, monkeypatch):
    """--torch-threads 0: a run starts with one thread, takes torch's default once two checks in a row find the CPUs
    idle, and fewer at once as other processes use them (a core a fifth used counts as busy); one where the system
    does not say."""
    module = importlib.import_module(script)
    # (time, busy CPU seconds of this process's 4 CPUs, this process's CPU seconds, CPUs): others use 0.1, 0.1,
    # 2.0, then 2.9 of them.
    readings = [(0, 0, 0, 4), (10, 20, 19, 4), (20, 40, 38, 4), (30, 80, 58, 4), (40, 119, 68, 4), None]
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


def test_threads_where_the_system_does_not_say(script, tmp_path, monkeypatch, capsys):
    """--torch-threads 0 without /proc/stat or an affinity (macOS): the run goes on with one thread, its progress
    lines saying so."""
    module = importlib.import_module(script)
    monkeypatch.setattr(module.Threads, "reading", lambda self: None)
    fake_clock(module, monkeypatch)
    clock = itertools.count(start=0.0, step=3.0)  # a check every reading
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    run_main(script, flags_with(TINY, torch_threads=0, eval_freq=0), tmp_path, monkeypatch)
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps/s" in line]
    assert lines
    assert all(line.endswith("| 1 thread") for line in lines), lines


def test_threads_beside_busy_processes(script):
    """The rule's reading of the system, live: one busy process on each CPU this process may use leaves one thread."""
    module = importlib.import_module(script)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    threads = torch.get_num_threads()
    try:
        time.sleep(0.5)  # the busy processes running
        rule = module.Threads()
        time.sleep(1.0)
        assert rule.last is not None  # Linux says: /proc/stat and the affinity
        assert rule.fits(rule.reading()) == 1
    finally:
        torch.set_num_threads(threads)
        for process in busy:
            process.kill()


def test_progress_after_resume(script, tmp_path, monkeypatch, capsys):
    """A resumed run's first progress line counts only its own updates (not the checkpoint's as if made in the first
    seconds) and shows the checkpoint's last evaluation."""
    half_steps, steps = (1000, 2000) if script == "erl_td3" else (300, 400)
    half = straight_run(script, tmp_path, monkeypatch, total_timesteps=half_steps, eval_freq=100)
    fake_clock(importlib.import_module(script), monkeypatch)
    capsys.readouterr()
    straight_run(
        script,
        tmp_path,
        monkeypatch,
        total_timesteps=steps,
        eval_freq=0,
        resume=Path(half["run_dir"]) / "checkpoint.pt",
    )
    line = next(line for line in capsys.readouterr().out.splitlines() if "steps/s" in line)
    sps, ups, last = re.search(r"\| (\d+) steps/s \| (\d+) updates/s \| last eval (.+) \| ETA", line).groups()
    assert int(ups) <= int(sps) + 1, line
    assert last == f"{half['eval_mean']:.1f} +- {half['eval_std']:.1f}", line


def test_progress_on_a_terminal(script, tmp_path, monkeypatch, capsys):
    """On a terminal the progress line is rewritten in place and fits its width, an evaluation line replaces it, and
    the run ends with a closing line (final evaluation, wall time, directory), leaving the cursor on a fresh line."""
    fake_clock(importlib.import_module(script), monkeypatch)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("COLUMNS", "60")  # a 400-step run's line is 76 characters: narrow enough to drop fields
    run_main(script, flags_with(TINY, eval_freq=0), tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "\r\033[Kstep " in out
    assert re.search(r"\r\033\[Kstep \d+/400 \| eval return ", out)  # the final evaluation, over the progress line
    assert out.endswith("\n")
    progress = [part for part in out.replace("\n", "\r").split("\r") if "steps/s" in part]
    assert progress
    assert all(len(part.removeprefix("\033[K")) < 60 and "ETA" in part for part in progress), progress  # no wrap
    assert re.search(r"\nfinished 400 steps in \d+:\d\d:\d\d: final eval .+; .+\n$", out), out[-300:]

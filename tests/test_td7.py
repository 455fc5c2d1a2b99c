"""TD7's own parts: AvgL1Norm, LAP-Huber, LAP replay, the update cascade, value clipping, the checkpoint
policy and offline mode."""

import numpy as np
import pytest
import torch

import td7_continuous as td7
from tests.conftest import (
    TINY,
    assert_same,
    flags_with,
    load_checkpoint,
    logged_losses,
    run_cli,
    run_main,
    signal_when,
    start_cli,
)


def filled_buffer(n=64, capacity=128, batch_size=5000, device="cpu"):
    rb = td7.LAPReplayBuffer(capacity, obs_dim=3, act_dim=2, batch_size=batch_size, device=torch.device(device))
    g = np.random.default_rng(0)
    rb.add(g.normal(size=(n, 3)), g.uniform(-1, 1, (n, 2)), g.normal(size=n), np.zeros(n), g.normal(size=(n, 3)))
    return rb


def test_avg_l1_norm_by_hand():
    x = torch.tensor([[1.0, -3.0], [0.0, 0.0]])
    # mean |x| of row 0 is 2; row 1 is all zeros, so the 1e-8 floor keeps it finite.
    assert torch.equal(td7.AvgL1Norm(x), torch.tensor([[0.5, -1.5], [0.0, 0.0]]))


def test_lap_huber_by_hand():
    td = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
    # row 0: 0.5*0.25 + 1*2 = 2.125; row 1: 1*1 (td == min_priority is linear) + 0 = 1.0; mean 1.5625
    assert td7.LAP_huber(td, min_priority=1.0).item() == pytest.approx(1.5625)
    assert td7.LAP_huber(td, min_priority=3.0).item() == pytest.approx((0.125 + 2.0 + 0.5) / 2)


@pytest.mark.parametrize("exact, compiled", [(False, False), (True, False), (True, True)])
def test_lap_samples_in_proportion_to_priority(exact, compiled):
    """The sum runs over the whole ring (the length stays on the device), half of it unwritten; with a float sum, or
    the exact integer one of a deterministic GPU run, also under torch.compile (its draws are integers: a float64
    draw would be float32 under inductor on a GPU, tests/test_gpu.py)."""
    rb = filled_buffer(n=4, capacity=8)
    rb.exact = exact
    rb.priority[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sample = torch.compile(rb.sample) if compiled else rb.sample
    torch.manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20):
        sample()
        counts += torch.bincount(rb.idx, minlength=4)
    freq = counts / counts.sum()
    # 100k draws: the standard error of each frequency is below 0.0015; a uniform sampler gives 0.25 each.
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.006), freq
    assert set(rb.idx.tolist()) <= {0, 1, 2, 3}  # never an empty row


def test_priority_update_max_priority_and_reset():
    rb = filled_buffer(n=8, capacity=16, batch_size=3)
    assert torch.equal(rb.priority[:8], torch.ones(8))
    assert rb.max_priority.item() == 1.0
    rb.sample()
    rb.idx.copy_(torch.tensor([0, 3, 5]))  # distinct rows, as if sampled
    rb.update_priority(torch.tensor([5.0, 2.0, 3.0]))
    assert rb.priority[:8].tolist() == [5.0, 1.0, 1.0, 2.0, 1.0, 3.0, 1.0, 1.0]
    assert rb.max_priority.item() == 5.0
    rb.add(np.zeros((1, 3)), np.zeros((1, 2)), np.zeros(1), np.zeros(1), np.zeros((1, 3)))
    assert rb.priority[8].item() == 5.0  # new rows get the max priority
    rb.priority[:9] = torch.linspace(1.0, 2.0, 9)
    rb.reset_max_priority()
    assert rb.max_priority.item() == 2.0  # the max currently stored, not the all-time max


def td7_run(tmp_path, monkeypatch, total_timesteps, **overrides):
    """The final checkpoint's state and counters of a TD7 run on the counter env (one update per env step once an
    episode has ended after --learning-starts), with a target cascade every 3 updates."""
    overrides = {"target_update_rate": 3, **overrides}
    flags = flags_with(
        TINY,
        env_id="tests.toy_envs:Counter-v0",
        total_timesteps=total_timesteps,
        learning_starts=20,
        batch_size=16,
        eval_freq=0,
        checkpoint_freq=total_timesteps,
        **overrides,
    )
    # A directory per run: two runs of the same length in the same second would otherwise share a run name.
    run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
    run = run_main("td7_continuous", flags + ["--no-checkpoints"], run_dir, monkeypatch)
    checkpoint = load_checkpoint(run["run_dir"])
    return checkpoint["state"], checkpoint["loop"]["num_updates"]


def test_cascade_gives_fixed_target_encoder_the_old_fixed_encoder(tmp_path, monkeypatch):
    """Two runs of the same seed, ending right after a cascade and right after the next one: at the later one the
    fixed target encoder holds what the fixed encoder held at the earlier one, the fixed encoder the encoder, the
    targets their networks, and the value clip the range of the targets seen so far."""
    _, probe_updates = td7_run(tmp_path, monkeypatch, 60)
    steps = 60 - probe_updates % 3  # one update per env step: this run ends on a cascade
    earlier, earlier_updates = td7_run(tmp_path, monkeypatch, steps)
    later, later_updates = td7_run(tmp_path, monkeypatch, steps + 3)
    assert earlier_updates % 3 == 0
    assert later_updates == earlier_updates + 3 > 3
    for key, value in later["fixed_encoder_target"].items():
        assert torch.equal(value, earlier["fixed_encoder"][key]), key
    for key, value in later["fixed_encoder"].items():
        assert torch.equal(value, later["encoder"][key]), key
        assert not torch.equal(value, earlier["fixed_encoder"][key]), key  # the encoder trained in between
    for target, network in [("actor_target", "actor"), ("qf_target", "qf")]:
        assert all(torch.equal(v, later[network][k]) for k, v in later[target].items()), target
    assert torch.equal(later["value_bounds"]["clip"], later["value_bounds"]["range"])


def test_value_clip_is_zero_until_the_first_cascade(tmp_path, monkeypatch):
    """Before the first cascade every target is clipped to reward + gamma * 0: the range of the targets seen is the
    range of the rewards sampled (the counter env's reward is 1 at every step)."""
    state, num_updates = td7_run(tmp_path, monkeypatch, 24, target_update_rate=1000)
    assert 0 < num_updates < 1000
    assert state["value_bounds"]["clip"].tolist() == [0.0, 0.0]
    assert state["value_bounds"]["range"].tolist() == [1.0, 1.0]


def test_checkpoint_policy_state_machine():
    args = td7.Args(steps_before_checkpointing=1000, max_eps_when_checkpointing=3, reset_weight=0.9)
    policy = td7.CheckpointPolicy()
    # One episode judges a policy at first: the first one always becomes the checkpoint.
    assert policy.episode_end(length=100, episode_return=50.0) == (True, 100)
    assert policy.best_min_return == 50.0
    assert policy.episode_end(length=80, episode_return=40.0) == (False, 80)  # worse: no checkpoint, train
    assert policy.episode_end(length=90, episode_return=60.0) == (True, 90)
    # The switch at steps_before_checkpointing: 3 episodes, and the bar lowered to 0.9 * 60.
    policy.before_update(999, args)
    assert policy.max_eps_before_update == 1
    policy.before_update(1000, args)
    assert policy.max_eps_before_update == 3
    assert policy.best_min_return == pytest.approx(54.0)
    assert policy.episode_end(length=10, episode_return=70.0) == (False, 0)  # still judging
    assert policy.episode_end(length=20, episode_return=55.0) == (False, 0)
    assert policy.episode_end(length=30, episode_return=65.0) == (True, 60)  # min 55 >= 54: checkpoint
    assert policy.best_min_return == 55.0
    # Early termination: the first episode below the bar ends the judging and trains on what it took.
    assert policy.episode_end(length=40, episode_return=80.0) == (False, 0)
    assert policy.episode_end(length=50, episode_return=10.0) == (False, 90)
    assert policy.eps_since_update == 0
    assert policy.min_return == 1e8


def test_offline_mode_trains_on_a_saved_buffer(tmp_path):
    online = run_cli("td7_continuous", flags_with(TINY, checkpoint_freq=0) + ["--save-buffer"], tmp_path)
    assert online.returncode == 0, online.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    data = np.load(run_dir / "buffer.npz")
    assert data["observations"].shape == (400, 11)
    assert data["actions"].shape == (400, 3)
    assert np.abs(data["actions"]).max() <= 1.0  # Hopper's bounds are [-1, 1]
    offline_dir = tmp_path / "offline"
    offline_dir.mkdir()
    flags = [
        "--offline",
        "--dataset",
        f"../runs/{run_dir.name}/buffer.npz",  # relative to where it runs; a resume from elsewhere reads the same file
        "--total-timesteps",
        "300",
        "--batch-size",
        "32",
        "--eval-freq",
        "150",
        "--eval-episodes",
        "2",
        "--checkpoint-freq",
        "150",
        "--no-cuda",
        "--torch-threads",
        "1",
    ]
    result = run_cli("td7_continuous", flags, offline_dir)
    assert result.returncode == 0, result.stderr
    (offline_run,) = (offline_dir / "runs").iterdir()
    checkpoint = load_checkpoint(offline_run)
    assert checkpoint["loop"]["num_updates"] == 300
    assert len(checkpoint["state"]["rb"]["data"]) == 400
    assert checkpoint["args"]["dataset"] == str(run_dir / "buffer.npz")
    resumed = run_cli(
        "td7_continuous", ["--resume", str(offline_run / "checkpoint.pt"), "--total-timesteps", "350"], tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    bad = run_cli("td7_continuous", ["--offline", "--dataset", str(offline_run / "args.json")], offline_dir)
    assert bad.returncode == 1
    assert bad.stderr.strip().startswith("error: cannot read --dataset")


@pytest.mark.parametrize("flag", [["--learning-starts", "10"], ["--no-checkpoints"], ["--num-envs", "2"]])
def test_offline_refuses_the_flags_it_would_ignore(flag, tmp_path):
    result = run_cli("td7_continuous", ["--offline", "--dataset", "data.npz", *flag], tmp_path, timeout=60)
    assert result.returncode == 1
    assert not (tmp_path / "runs").exists()
    assert (
        result.stderr.strip() == f"error: {flag[0]} has no effect with --offline: it trains on the whole "
        "dataset, one update per step, without policy checkpoints"
    )


def counter_dataset(rows=40):
    """A valid dataset of the counter env (observation of size 1; actions in [0, 1] x [-2, 4])."""
    g = np.random.default_rng(0)
    return {
        "observations": g.normal(size=(rows, 1)),
        "actions": g.uniform([0, -2], [1, 4], (rows, 2)),
        "rewards": g.normal(size=rows),
        "next_observations": g.normal(size=(rows, 1)),
        "terminals": np.zeros(rows),
    }


def with_row(array, row, value):
    array = array.copy()
    array[row] = value
    return array


BAD_DATASETS = {
    "terminal of 0.5": ({"terminals": with_row(np.zeros(40), 3, 0.5)}, "terminals must be 0 or 1, but row 3 holds 0.5"),
    "action beyond its bound": (
        {"actions": with_row(counter_dataset()["actions"], 5, [0.5, 4.25])},
        "actions lie outside the env's bounds, by up to 0.25 (row 5, column 1: 4.25, bounds [-2, 4])",
    ),
    "NaN observation": (
        {"observations": with_row(np.zeros((40, 1)), 7, np.nan)},
        "observations holds a non-finite value, nan, in row 7, column 0",
    ),
    "infinite reward": (
        {"rewards": with_row(np.zeros(40), 2, np.inf)},
        "rewards holds a non-finite value, inf, in row 2",
    ),
    "fewer rows than a batch": (
        {key: value[:10] for key, value in counter_dataset().items()},
        "holds 10 transitions, fewer than --batch-size 16",
    ),
    "0-d rewards": ({"rewards": np.float64(1.0)}, "rewards has shape (), the env needs (40,)"),
    "0-d observations": ({"observations": np.float64(1.0)}, "observations has shape (), the env needs (N, 1)"),
    "actions of another env": ({"actions": np.zeros((40, 3))}, "actions has shape (40, 3), the env needs (40, 2)"),
    "complex rewards": (
        {"rewards": np.zeros(40) + 1j},
        "rewards holds values of type complex128; TD7 needs real numbers",
    ),
    "text terminals": (
        {"terminals": np.array(["0"] * 40)},
        "terminals holds values of type <U1; TD7 needs real numbers",
    ),
}


@pytest.mark.parametrize("case", BAD_DATASETS)
def test_offline_refuses_a_bad_dataset(case, tmp_path, monkeypatch, capsys):
    """A dataset TD7 cannot train on is refused with one error line naming what is wrong and where, before anything
    is written (no run directory)."""
    changes, expected = BAD_DATASETS[case]
    np.savez(tmp_path / "data.npz", **{**counter_dataset(), **changes})
    flags = [
        "--env-id",
        "tests.toy_envs:Counter-v0",
        "--offline",
        "--dataset",
        str(tmp_path / "data.npz"),
        "--batch-size",
        "16",
        "--total-timesteps",
        "50",
        "--no-cuda",
        "--torch-threads",
        "1",
    ]
    with pytest.raises(SystemExit) as exit_info:
        run_main("td7_continuous", flags, tmp_path, monkeypatch)
    assert exit_info.value.code == 1
    assert (
        capsys.readouterr().err
        == f"error: --dataset {tmp_path / 'data.npz'}" + (" " if "fewer" in case else ": ") + expected + "\n"
    )  # that one line on stderr
    assert not (tmp_path / "runs").exists()


def test_sigterm_inside_a_burst(tmp_path):
    """MountainCarContinuous's episodes take 999 steps, so the first burst (at the second episode's end, step 1998) is
    999 updates, seconds long. SIGTERM sent inside it ends the run within seconds (143, one line), leaving a checkpoint
    with the updates still due; --resume makes them before the next env step, and ends where an uninterrupted run
    ends, bit for bit."""
    flags = flags_with(
        TINY,
        env_id="MountainCarContinuous-v0",
        total_timesteps=2100,
        eval_freq=0,
        eval_episodes=1,
        checkpoint_freq=1997,
    )  # a checkpoint at the step before the burst: the signal's cue
    (tmp_path / "straight").mkdir()
    assert run_cli("td7_continuous", flags, tmp_path / "straight").returncode == 0
    proc = start_cli("td7_continuous", flags, tmp_path)
    stderr = signal_when(proc, lambda: list(tmp_path.glob("runs/*/checkpoint.pt")), settle=0.5, within=3)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (
        stderr.strip() == f"SIGTERM at global_step 1998: checkpoint written; continue with --resume "
        f"{run_dir / 'checkpoint.pt'}"
    )
    loop = load_checkpoint(run_dir)["loop"]
    assert loop["global_step"] == 1998
    assert 0 < loop["updates_due"] < 999 == loop["updates_due"] + loop["num_updates"]
    resumed = run_cli("td7_continuous", ["--resume", str(run_dir / "checkpoint.pt")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    (straight_dir,) = (tmp_path / "straight" / "runs").iterdir()
    a, b = load_checkpoint(straight_dir), load_checkpoint(run_dir)
    assert a["loop"]["num_updates"] == 999
    for key in ("loop", "state", "envs", "rng"):
        assert_same(a[key], b[key], key)
    assert logged_losses(straight_dir) == logged_losses(run_dir)  # no point at 1998 from the burst's first part

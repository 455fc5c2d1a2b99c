"""Unit tests of the parts of SAC that are easy to get subtly wrong, continuous and discrete, and the Atari path."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import sac_continuous
import sac_discrete
from tests.conftest import TINY, check_memory, flags_with, load_checkpoint, run_main


def test_tanh_gaussian_log_prob_matches_numerical_density():
    """log pi(a) of a = tanh(u), u ~ N(mean, std), against the density of a obtained numerically: the finite
    difference of its CDF P(A <= a) = Phi((atanh(a) - mean) / std), per dimension, summed over dimensions."""
    torch.manual_seed(0)
    mean = torch.tensor([[0.3, -1.2, 2.5]], dtype=torch.float64).expand(2000, -1)
    log_std = torch.tensor([[-0.5, 0.2, -1.0]], dtype=torch.float64).expand(2000, -1)
    action, log_prob = sac_continuous.tanh_gaussian_sample(mean, log_std)
    normal = torch.distributions.Normal(mean, log_std.exp())
    h = 1e-6
    lo, hi = (action - h).clamp(-1 + 1e-12, 1 - 1e-12), (action + h).clamp(-1 + 1e-12, 1 - 1e-12)
    density = (normal.cdf(torch.atanh(hi)) - normal.cdf(torch.atanh(lo))) / (hi - lo)
    ok = (action.abs() < 0.999).all(-1)  # where the finite difference itself is accurate
    assert ok.sum() > 1000
    assert torch.allclose(log_prob[ok, 0], density.log().sum(-1)[ok], atol=1e-3)


def test_tanh_gaussian_log_prob_is_finite_where_tanh_saturates():
    action, log_prob = sac_continuous.tanh_gaussian_sample(torch.full((1, 1), 30.0), torch.full((1, 1), -5.0))
    assert action.item() == 1.0
    assert torch.isfinite(log_prob).all()


def test_actor_mode_is_tanh_of_mean():
    actor = sac_continuous.Actor(3, 2)
    obs = torch.randn(4, 3)
    assert torch.equal(actor.mode(obs), torch.tanh(actor(obs)[0]))


def alpha_after_one_step(update_alpha, statistic, target_entropy):
    log_alpha = torch.zeros((), requires_grad=True)  # alpha = 1
    optimizer = torch.optim.Adam([log_alpha], lr=0.1)
    update_alpha(statistic, log_alpha, optimizer, target_entropy)
    return log_alpha.exp().item()


@pytest.mark.parametrize("entropy,grows", [(-2.0, True), (3.0, False)])
def test_alpha_moves_towards_target_entropy_continuous(entropy, grows):
    """Target entropy -1 (that is -dim(A) for one dimension); the entropy estimate is -log pi."""
    alpha = alpha_after_one_step(sac_continuous.update_alpha, torch.full((8, 1), -entropy), -1.0)
    assert (alpha > 1.0) == grows
    assert alpha != 1.0


@pytest.mark.parametrize("entropy,grows", [(0.1, True), (0.6, False)])
def test_alpha_moves_towards_target_entropy_discrete(entropy, grows):
    """Two actions, ratio 0.5: the target is 0.5 * log 2 = 0.35 nats."""
    alpha = alpha_after_one_step(sac_discrete.update_alpha, torch.full((8,), entropy), 0.5 * math.log(2))
    assert (alpha > 1.0) == grows
    assert alpha != 1.0


def test_discrete_target_terminated_vs_truncated():
    """V(s') is the exact expectation over pi(.|s'); only a termination drops it. A truncated transition is stored
    with terminated = 0, so it keeps the bootstrap."""
    probs = torch.tensor([[0.25, 0.75]])
    next_q = torch.tensor([[2.0, 4.0]])
    alpha, gamma = 0.5, 0.9
    expected_v = sum(p * (q - alpha * math.log(p)) for p, q in zip([0.25, 0.75], [2.0, 4.0]))
    reward = torch.tensor([[1.0]])
    y_terminated = sac_discrete.td_target(reward, torch.ones(1, 1), next_q, probs.log(), alpha, gamma)
    y_truncated = sac_discrete.td_target(reward, torch.zeros(1, 1), next_q, probs.log(), alpha, gamma)
    assert y_terminated.item() == pytest.approx(1.0)
    assert y_truncated.item() == pytest.approx(1.0 + gamma * expected_v)


def test_continuous_target_subtracts_entropy_term():
    y = sac_continuous.td_target(
        torch.ones(2, 1), torch.tensor([[0.0], [1.0]]), torch.full((2, 1), 3.0), torch.full((2, 1), -1.0), 0.2, 0.5
    )
    assert torch.allclose(y, torch.tensor([[1.0 + 0.5 * (3.0 + 0.2)], [1.0]]))


def test_discrete_actor_loss_is_full_expectation():
    """The actor loss is mean_s sum_a pi(a|s) (alpha log pi(a|s) - min_i Q_i(s, a)), computed by hand."""
    torch.manual_seed(0)
    actor, qf = sac_discrete.Actor((4,), 3), sac_discrete.Critic((4,), 3)
    obs = torch.randn(5, 4)
    log_pi, q = actor(obs).detach(), qf(obs).min(0).values.detach()
    expected = np.mean(
        [sum(math.exp(log_pi[s, a]) * (0.3 * log_pi[s, a] - q[s, a]) for a in range(3)) for s in range(5)]
    )
    loss, entropy = sac_discrete.update_actor(obs, actor, qf, torch.optim.SGD(actor.parameters(), lr=0.0), 0.3)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(entropy, -(log_pi.exp() * log_pi).sum(-1))


def test_discrete_critic_no_grad_in_actor_step():
    actor, qf = sac_discrete.Actor((4,), 3), sac_discrete.Critic((4,), 3)
    sac_discrete.update_actor(torch.randn(5, 4), actor, qf, torch.optim.SGD(actor.parameters(), lr=0.1), 0.3)
    assert all(p.grad is None for p in qf.parameters())


def test_vector_and_image_defaults():
    assert sac_discrete.OBSERVATION_DEFAULTS["image"] == dict(
        total_timesteps=5_000_000,
        learning_starts=20_000,
        batch_size=64,
        adam_eps=1e-4,
        update_frequency=4,
        tau=1.0,
        target_network_frequency=8000,
        target_entropy_ratio=0.89,
    )  # CleanRL's sac_atari
    assert set(sac_discrete.OBSERVATION_DEFAULTS["vector"]) == set(sac_discrete.OBSERVATION_DEFAULTS["image"])


def test_num_critics(tmp_path, monkeypatch):
    """--num-critics 3: three Q-networks (and targets), each trained: their weights differ from each other."""
    run = run_main(
        "sac_continuous", flags_with(TINY, num_critics=3, total_timesteps=250, eval_freq=0), tmp_path, monkeypatch
    )
    state = load_checkpoint(run["run_dir"])["state"]
    for name in ("qf", "qf_target"):
        assert all(w.shape[0] == 3 for key, w in state[name].items()), name
    first_layer = state["qf"]["weights.0"]
    assert not torch.equal(first_layer[0], first_layer[1])
    assert not torch.equal(first_layer[1], first_layer[2])


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_atari_smoke(tmp_path, monkeypatch):
    """Pong through the image path: AtariPreprocessing, 4 stacked uint8 frames, Nature-CNN, frame replay."""
    flags = flags_with(
        TINY,
        env_id="PongNoFrameskip-v4",
        total_timesteps=300,
        learning_starts=100,
        eval_freq=0,
        eval_episodes=1,
        checkpoint_freq=300,
    )
    run = run_main("sac_discrete", flags, tmp_path, monkeypatch)
    rb = load_checkpoint(run["run_dir"])["state"]["rb"]
    assert rb["frame"].dtype == torch.uint8
    assert rb["frame"].shape == (1, 1001, 84, 84)  # each frame once: --buffer-size 1000 rows, and one to spare
    assert int(rb["valid"].sum()) == 300  # every transition, none lost (no episode of Pong ends within 300 steps)
    assert set(rb["reward"][rb["valid"]].unique().tolist()) <= {-1.0, 0.0, 1.0}  # clipped to their sign


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_evaluation_of_a_policy_that_never_fires_ends_in_breakout():
    """Breakout needs FIRE to serve: a policy that always answers NOOP would wait out ALE's 108,000-frame cap (26,995
    agent steps) per episode; evaluation presses FIRE at the start of each life, so the five lives are lost within a
    few hundred steps."""
    steps = []

    def noop(obs):
        steps.append(1)
        return torch.zeros(len(obs), dtype=torch.long)

    returns = sac_discrete.evaluate(noop, "BreakoutNoFrameskip-v4", 1, 0, torch.device("cpu"), stop=lambda: False)
    assert len(steps) < 2000, len(steps)
    assert returns[0] >= 0


def recorded_actions(env):
    """The actions that reach AtariPreprocessing under `env`'s other wrappers, as they are sent."""
    inner = env
    while not isinstance(inner, gym.wrappers.AtariPreprocessing):
        inner = inner.env
    actions, step = [], inner.step
    inner.step = lambda action: (actions.append(int(action)), step(action))[1]
    return actions


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_atari_training_ends_an_episode_at_a_lost_life_and_fires_after_each_reset():
    """CleanRL's sac_atari wrappers by default: every reset sends FIRE and then action 2; a lost life ends the
    training episode (terminated) and the next reset continues the same game (a no-op, then FIRE); only the last
    life's end resets the game, and games_over counts only that one, in a vector env. --machado: no FIRE, whole
    games."""
    fire = 1
    env = sac_discrete.make_env("BreakoutNoFrameskip-v4")()
    actions = recorded_actions(env)
    env.reset(seed=0)
    assert actions == [fire, 2]
    rng, ends = np.random.default_rng(0), []
    while not ends or ends[-1]:
        lives = env.unwrapped.ale.lives()
        _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
        if terminated or truncated:
            ends.append(info["life_lost"])
            if info["life_lost"]:
                assert terminated and 0 < env.unwrapped.ale.lives() == lives - 1
                frame = env.unwrapped.ale.getEpisodeFrameNumber()
                del actions[:]
                env.reset()
                assert actions == [0, fire, 2]
                assert env.unwrapped.ale.getEpisodeFrameNumber() > frame  # the same game goes on
    assert ends == [True] * 4 + [False]  # Breakout's five lives
    envs = gym.vector.SyncVectorEnv(
        [sac_discrete.make_env("BreakoutNoFrameskip-v4")], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.reset(seed=0)
    episodes, games = 0, 0
    while not games:
        _, _, terminated, truncated, infos = envs.step(rng.integers(4, size=1))
        episodes += int((terminated | truncated).sum())
        games += len(sac_discrete.games_over(terminated, truncated, infos))
    assert (episodes, games) == (5, 1)
    machado = sac_discrete.make_env("BreakoutNoFrameskip-v4", machado=True)()
    actions = recorded_actions(machado)
    machado.reset(seed=0)
    assert actions == []
    while True:
        _, _, terminated, truncated, _ = machado.step(fire)
        if terminated or truncated:
            break
    assert machado.unwrapped.ale.lives() == 0


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_image_networks_are_initialised_as_sac_atari():
    """Kaiming-normal weights (std sqrt(2 / fan_in)) and zero biases in every layer of the image networks."""
    torch.manual_seed(0)
    actor = sac_discrete.Actor((4, 84, 84), 6)
    layers = [m for m in actor.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(layers) == 5
    for layer in layers:
        assert torch.count_nonzero(layer.bias) == 0
        fan_in = layer.weight[0].numel()
        assert layer.weight.std().item() == pytest.approx(math.sqrt(2 / fan_in), rel=0.15)


def test_frame_buffer_rebuilds_every_stored_observation():
    """Two envs of 2x2 'frames' numbered by (env, episode, step), stacked by 4 with the first frame repeated before an
    episode's start, episodes of random lengths, a ring of 25 rows per env that wraps several times: every
    transition the buffer samples is one that was added (obs, action, reward, terminated, next obs), and the
    transitions added last are all still there, none lost to the ring but the oldest."""
    rng = np.random.default_rng(0)
    rb = sac_discrete.FrameReplayBuffer(48, (4, 2, 2), 2, 5000, torch.device("cpu"))
    frame = lambda env, episode, t: np.full((2, 2), (env * 50 + episode * 7 + t) % 256, np.uint8)  # noqa: E731
    stacks = [[frame(e, 0, 0)] * 4 for e in range(2)]
    episode, t, added = [0, 0], [0, 0], []
    for step in range(200):
        obs = np.stack([np.stack(s) for s in stacks])
        action, reward = rng.integers(0, 6, 2), rng.normal(size=2).astype(np.float32)
        done = rng.uniform(size=2) < 0.15
        terminated = done & (rng.uniform(size=2) < 0.5)
        next_stacks = [stacks[e][1:] + [frame(e, episode[e], t[e] + 1)] for e in range(2)]
        next_obs = np.stack([np.stack(s) for s in next_stacks])
        rb.add(obs, action, reward, terminated.astype(np.float32), next_obs, done)
        added.append(
            [
                (obs[e].tobytes(), int(action[e]), float(reward[e]), float(terminated[e]), next_obs[e].tobytes())
                for e in range(2)
            ]
        )
        for e in range(2):
            t[e] += 1
            stacks[e] = next_stacks[e]
            if done[e]:
                episode[e], t[e] = episode[e] + 1, 0
                stacks[e] = [frame(e, episode[e], 0)] * 4
    everything = {transition for step in added for transition in step}
    obs, action, reward, terminated, next_obs = rb.sample()
    sampled = {
        (o.numpy().tobytes(), int(a), float(r), float(d), n.numpy().tobytes())
        for o, a, r, d, n in zip(obs, action, reward[:, 0], terminated[:, 0], next_obs)
    }
    assert sampled <= everything
    assert {transition for step in added[-15:] for transition in step} <= sampled
    restored = sac_discrete.FrameReplayBuffer(48, (4, 2, 2), 2, 100, torch.device("cpu"))
    restored.load_state_dict(rb.state_dict())
    torch.manual_seed(1)
    rb.batch_size = 100
    again = rb.sample()
    torch.manual_seed(1)
    assert all(torch.equal(x, y) for x, y in zip(again, restored.sample()))
    assert restored.new_episode.all()  # a resumed run starts new episodes


def test_default_atari_replay_fits_a_24_gb_gpu():
    """1e6 transitions of 4x84x84 frames, each frame stored once: about 7 GB (storing obs and next obs: 56 GB)."""
    rb = sac_discrete.FrameReplayBuffer(1_000_000, (4, 84, 84), 1, 64, torch.device("meta"))
    size = sum(t.numel() * t.element_size() for t in rb.fields.values())
    assert 7.0e9 < size < 7.2e9


def test_frame_buffer_uploads_once_per_step_and_samples_valid_rows_uniformly(monkeypatch):
    """One upload per vector step (on a GPU: one asynchronous copy from pinned memory, not one blocking copy per
    field and index); a batch drawn uniformly over the rows that start a transition (each row's observation told by
    its newest frame), exactly (integer draws, no float prefix sum) and again the same from the same seed."""
    uploads = []
    upload = sac_discrete.upload
    monkeypatch.setattr(sac_discrete, "upload", lambda array, device: uploads.append(array) or upload(array, device))
    rb = sac_discrete.FrameReplayBuffer(20, (4, 2, 2), 2, 100_000, torch.device("cpu"))
    for step in range(30):
        obs = np.stack([np.full((4, 2, 2), 2 * step + env, np.uint8) for env in range(2)])
        rb.add(obs, np.array([1, 2]), np.ones(2, np.float32), np.zeros(2, np.float32), obs + 2, [False, step == 9])
    assert len(uploads) == 30
    torch.manual_seed(0)
    batch = rb.sample()
    hits = torch.bincount(batch[0][:, -1, 0, 0].long()).float()
    hits = hits[hits > 0]
    assert len(hits) == rb.fields["valid"].sum() > 10  # every valid row is drawn, and no other
    expected = 100_000 / len(hits)
    # each row's count is binomial: within 5 standard deviations of the mean
    assert ((hits - expected).abs() < 5 * expected**0.5).all(), hits
    torch.manual_seed(0)
    assert all(torch.equal(x, y) for x, y in zip(batch, rb.sample()))


def test_frames_without_room_on_the_gpu_go_to_pinned_host_memory(monkeypatch, host_memory):
    """Atari frames a GPU has no room for go to pinned host memory, whose allocator rounds each tensor up to a power
    of two (twice the bytes at most), beside the checkpoint's host copy: three times the buffer's bytes on the host.
    With less there, or for a vector replay (never moved), the run is refused naming the GPU's memory."""
    cuda, gib = torch.device("cuda"), 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gib, 24 * gib))
    frames = 7.1e9  # 1e6 Atari transitions, each frame stored once
    host_memory["free"] = 3 * frames + 2**20  # (read in kB)
    assert check_memory(sac_discrete, cuda, frames, monkeypatch, frames=True) == (cuda, torch.device("cpu"))
    # room on the GPU: it stays there
    assert check_memory(sac_discrete, cuda, 0.5 * gib, monkeypatch, frames=True) == (cuda, cuda)
    with pytest.raises(SystemExit):
        check_memory(sac_discrete, cuda, frames, monkeypatch, frames=False)
    host_memory["free"] = 3 * frames - 2**20
    with pytest.raises(SystemExit):
        check_memory(sac_discrete, cuda, frames, monkeypatch, frames=True)

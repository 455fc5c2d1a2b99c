"""Unit tests of the parts of SAC that are easy to get subtly wrong, continuous and discrete, and the Atari path."""
import math

import numpy as np
import pytest
import torch

import sac_continuous
import sac_discrete
from tests.conftest import TINY, flags_with, load_checkpoint, run_main


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
    y = sac_continuous.td_target(torch.ones(2, 1), torch.tensor([[0.0], [1.0]]), torch.full((2, 1), 3.0),
                                  torch.full((2, 1), -1.0), 0.2, 0.5)
    assert torch.allclose(y, torch.tensor([[1.0 + 0.5 * (3.0 + 0.2)], [1.0]]))


def test_discrete_actor_loss_is_full_expectation():
    """The actor loss is mean_s sum_a pi(a|s) (alpha log pi(a|s) - min_i Q_i(s, a)), computed by hand."""
    torch.manual_seed(0)
    actor, qf = sac_discrete.Actor((4,), 3), sac_discrete.Critic((4,), 3)
    obs = torch.randn(5, 4)
    log_pi, q = actor(obs).detach(), qf(obs).min(0).values.detach()
    expected = np.mean([sum(math.exp(log_pi[s, a]) * (0.3 * log_pi[s, a] - q[s, a]) for a in range(3))
                        for s in range(5)])
    loss, entropy = sac_discrete.update_actor(obs, actor, qf, torch.optim.SGD(actor.parameters(), lr=0.0), 0.3)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(entropy, -(log_pi.exp() * log_pi).sum(-1))


def test_discrete_critic_no_grad_in_actor_step():
    actor, qf = sac_discrete.Actor((4,), 3), sac_discrete.Critic((4,), 3)
    sac_discrete.update_actor(torch.randn(5, 4), actor, qf, torch.optim.SGD(actor.parameters(), lr=0.1), 0.3)
    assert all(p.grad is None for p in qf.parameters())


def test_vector_and_image_defaults():
    assert sac_discrete.OBSERVATION_DEFAULTS["image"] == dict(
        total_timesteps=5_000_000, learning_starts=20_000, batch_size=64, adam_eps=1e-4, update_frequency=4, tau=1.0,
        target_network_frequency=8000)  # CleanRL's sac_atari
    assert set(sac_discrete.OBSERVATION_DEFAULTS["vector"]) == set(sac_discrete.OBSERVATION_DEFAULTS["image"])


def test_num_critics(tmp_path, monkeypatch):
    """--num-critics 3: three Q-networks (and targets), each trained: their weights differ from each other."""
    run = run_main("sac_continuous", flags_with(TINY, num_critics=3, total_timesteps=250, eval_freq=0), tmp_path,
                   monkeypatch)
    state = load_checkpoint(run["run_dir"])["state"]
    for name in ("qf", "qf_target"):
        assert all(w.shape[0] == 3 for key, w in state[name].items()), name
    first_layer = state["qf"]["weights.0"]
    assert not torch.equal(first_layer[0], first_layer[1])
    assert not torch.equal(first_layer[1], first_layer[2])


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_atari_smoke(tmp_path, monkeypatch):
    """Pong through the image path: AtariPreprocessing, 4 stacked uint8 frames, Nature-CNN, uint8 replay."""
    flags = flags_with(TINY, env_id="PongNoFrameskip-v4", total_timesteps=300, learning_starts=100, eval_freq=0,
                       eval_episodes=1, checkpoint_freq=300)
    run = run_main("sac_discrete", flags, tmp_path, monkeypatch)
    rb = load_checkpoint(run["run_dir"])["state"]["rb"]
    assert rb["obs"].shape == (300, 4, 84, 84)
    assert rb["obs"].dtype == torch.uint8
    assert set(rb["reward"].unique().tolist()) <= {-1.0, 0.0, 1.0}  # clipped to their sign
    # No episode of Pong ends within 300 steps: each row's next frames are the next row's, and the stack of 4 moves
    # on by one frame per step.
    assert torch.equal(rb["next_obs"][:-1], rb["obs"][1:])
    assert torch.equal(rb["obs"][1:, :3], rb["obs"][:-1, 1:])


@pytest.mark.skipif(sac_discrete.ale_py is None, reason="the Atari path needs the optional ale-py")
def test_evaluation_of_a_policy_that_never_fires_ends_in_breakout():
    """Breakout needs FIRE to serve: a policy that always answers NOOP would wait out ALE's 108,000-frame cap (26,995
    agent steps) per episode; evaluation presses FIRE at the start of each life, so the five lives are lost within a
    few hundred steps."""
    steps = []

    def noop(obs):
        steps.append(1)
        return torch.zeros(len(obs), dtype=torch.long)

    returns = sac_discrete.evaluate(noop, "BreakoutNoFrameskip-v4", 1, 0, torch.device("cpu"))
    assert len(steps) < 2000, len(steps)
    assert returns[0] >= 0


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

"""TD3's own parts: the target, the replay buffer, action scaling, the critic."""

import numpy as np
import torch

import td3_continuous as td3


def test_target_bootstraps_through_truncation_not_termination():
    reward, next_q = torch.tensor([[1.0], [1.0]]), torch.tensor([[10.0], [10.0]])
    terminated = torch.tensor([[1.0], [0.0]])  # row 0 terminated; row 1 truncated (stored as not terminated)
    target = td3.td_target(reward, terminated, next_q, gamma=0.99)
    assert torch.allclose(target, torch.tensor([[1.0], [1.0 + 0.99 * 10.0]]))


def test_buffer_wraps_around_and_samples_only_filled_rows():
    """Rows written by slice, split where the ring wraps; sampled with the length on the device."""
    rb = td3.ReplayBuffer(capacity=5, obs_dim=1, act_dim=1, batch_size=2000, device=torch.device("cpu"))

    def add(values):  # two envs per step; obs identifies the row
        v = np.array(values, np.float64)
        rb.add(v[:, None], v[:, None], v, np.zeros(2), v[:, None] + 1)

    add([1, 2])
    add([3, 4])
    assert len(rb) == 4
    assert not rb.full
    obs = rb.sample()[0]
    assert set(obs.flatten().tolist()) == {1.0, 2.0, 3.0, 4.0}  # never an empty row
    add([5, 6])  # 6 goes to row 0: wrap-around
    assert rb.full
    assert rb.pos == 1
    assert len(rb) == 5
    assert rb.data[:, 0].tolist() == [6.0, 2.0, 3.0, 4.0, 5.0]
    obs, action, reward, terminated, next_obs = rb.sample()
    assert set(obs.flatten().tolist()) == {2.0, 3.0, 4.0, 5.0, 6.0}
    assert torch.equal(next_obs, obs + 1)
    assert torch.equal(action, obs)
    assert reward.shape == (2000, 1)
    assert rb.sample()[0].data_ptr() == obs.data_ptr()  # one batch tensor, refilled in place


def test_action_scaling_with_asymmetric_bounds():
    low, high = np.array([0.0, -2.0], np.float32), np.array([1.0, 4.0], np.float32)
    assert np.allclose(td3.to_env(np.array([-1.0, -1.0]), low, high), low)
    assert np.allclose(td3.to_env(np.array([1.0, 1.0]), low, high), high)
    assert np.allclose(td3.to_env(np.array([0.0, 0.0]), low, high), [0.5, 1.0])
    assert np.allclose(td3.to_env(np.array([0.5, -0.5]), low, high), [0.75, -0.5])


def test_critic_heads_are_independent_networks_and_fixed_q1_gives_no_critic_grads():
    torch.manual_seed(0)
    qf, actor = td3.Critic(3, 2), td3.Actor(3, 2)
    obs = torch.randn(8, 3)
    q = qf(obs, actor(obs))
    assert q.shape == (2, 8, 1)
    assert not torch.allclose(q[0], q[1])
    assert torch.allclose(qf.fixed(obs, actor(obs), num_q=1)[0], q[0])
    (-qf.fixed(obs, actor(obs), num_q=1)[0].mean()).backward()
    assert all(p.grad is None for p in qf.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.parameters())

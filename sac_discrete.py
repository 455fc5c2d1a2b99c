"""SAC for discrete actions, with automatic entropy tuning, in one file: vector or image (Atari) observations.

Paper: Christodoulou, "Soft Actor-Critic for Discrete Action Settings", 2019, https://arxiv.org/abs/1910.07207.
The actor is a Categorical policy; the critics output Q(s, .) for every action, so the target, the actor loss
and the alpha loss take full expectations over the actions instead of sampling:
  V(s') = sum_a' pi(a'|s') (min_i Q'_i(s', a') - alpha log pi(a'|s')),  y = r + gamma (1 - terminated) V(s')
  actor loss = mean_s sum_a pi(a|s) (alpha log pi(a|s) - min_i Q_i(s, a))
  alpha loss = mean_s -alpha * stopgrad(target_entropy - H(pi(.|s))),  target_entropy = ratio * log|A|
with alpha = exp(log_alpha) (the seed implementation's form), starting from alpha = 1 as CleanRL.
Image observations (Atari, with the optional ale-py) follow CleanRL's sac_atari.py: Nature-CNN per network,
Adam eps 1e-4, batch 64, one update every 4 env steps, hard target copy every 8,000 steps, 20k random steps.
Vector observations use 256-256 ReLU MLPs and SAC's usual one update per step with Polyak targets. The flags
whose default depends on the kind of observation say so in --help. Deliberate differences from CleanRL:
- --target-entropy-ratio defaults to 0.7 for vectors, not sac_atari's 0.89 (kept for images) nor the seed's
  0.98: on CartPole-v1 (log 2 = 0.69 nats at most) a ratio near 1 asks for a nearly uniform policy, alpha grows
  without bound and the stochastic policy stays near uniform; benchmark/results/sac_discrete_target_entropy.md
  has the measurements.
- The actor and alpha losses sum over the actions and average over states, the paper's expectation over
  actions (CleanRL averages over both: its losses and gradients are 1/|A| of these). Adam's step does not
  depend on that scale except through its epsilon, which matters only for gradients near it (1e-4 for images).
- Atari trains with CleanRL's sac_atari wrappers: gymnasium's AtariPreprocessing (30 no-op starts, frame skip 4
  with max-pooling, 84x84 greyscale), a lost life ends a training episode (EpisodicLife) and FIRE follows each
  reset (FireReset), 4 stacked frames, rewards clipped to their sign for training only; the logged training
  return is a whole game's score, as CleanRL logs it (the rewards of a reset's FIRE and no-op steps, dropped by
  those wrappers, are not in it). --machado trains on whole games without FIRE (Machado et al. 2018's
  protocol). Evaluation plays whole games and presses FIRE at the start of each life (FireOnLifeStart), so that
  an argmax policy that never fires does not wait out ALE's 108,000-frame cap in a game that needs FIRE. The
  Nature-CNN is initialised as sac_atari's (Kaiming-normal, zero biases). The replay buffer stores each frame
  once, as uint8 (FrameReplayBuffer): 1e6 transitions take about 7 GB (CleanRL's: 56), on the GPU when it has
  room, else in pinned host memory.
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its
  bootstrap and stores the true final observation; only `terminated` stops the bootstrap.
- The replay buffer is preallocated on the training device; nothing in the update
  waits for the device, except every --log-freq updates to log; an env step waits only for its action.
- Evaluation is deterministic: the mode of the policy, argmax of the logits.
- On a GPU the update steps run as CUDA graphs (--no-cudagraphs: eager, as ever); and --compile: docs/fast_path.md.
- Added: periodic deterministic evaluation, checkpoints with --resume, SIGINT/SIGTERM handling,
  a guard against non-finite losses, and one-line errors for bad input.

Two parts: the algorithm, from here to `main`; below the banner after it, the run machinery.
"""
import contextlib
import csv
import datetime
import fcntl
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
import types
import warnings
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

try:  # the optional Atari envs (pip install ale-py): registers the ALE/... and ...NoFrameskip-v4 ids
    import ale_py

    gym.register_envs(ale_py)
except ImportError:
    ale_py = None

# The -v4 MuJoCo envs are kept on purpose: the published results this project compares with use them.
warnings.filterwarnings("ignore", message=".*is out of date. You should consider upgrading.*")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs)"""
    torch_deterministic: bool = False
    """on a GPU, the same numbers every run: deterministic algorithms, at a price (docs/fast_path.md)"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 0
    """CPU threads for torch: 0 chooses them as the run goes (the CPUs this process may use that other processes
    leave idle, one when none is; rechecked every 2 s, shown on the progress line); N fixes N (docs/command_line.md)"""
    track: bool = False
    """log to Weights and Biases (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "rl-baselines"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    capture_video: bool = False
    """record the first episode of every evaluation to videos/{run_name}"""
    save_model: bool = False
    """write the final networks to runs/{run_name}/model.pt"""
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: Optional[int] = None
    """total environment steps of the run (default: 100000 for vector observations, 5000000 for images)"""
    num_envs: int = 1
    """parallel training environments (one gradient update per vector step)"""
    learning_starts: Optional[int] = None
    """environment steps of uniformly random actions before learning starts (default: 5000 for vector
    observations, 20000 for images)"""
    buffer_size: int = 1000000
    """the replay memory size"""
    batch_size: Optional[int] = None
    """the batch size of samples from the replay memory (default: 256 for vector observations, 64 for images)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    eval_freq: int = 5000
    """deterministic evaluation every this many env steps (0: only the final evaluation)"""
    eval_episodes: int = 10
    """episodes per evaluation"""
    checkpoint_freq: int = 100000
    """write runs/{run_name}/checkpoint.pt every this many env steps and at the end (0: never)"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue from (the run keeps its directory)"""
    log_freq: int = 100
    """log the mean of the losses over this many updates, and check them for NaN"""
    compile: bool = False
    """torch.compile the update steps (CPU or GPU; the same numbers up to float rounding)"""
    cudagraphs: bool = True
    """on a GPU, each update step captured once as a CUDA graph and replayed (--no-cudagraphs: eager)"""

    # Algorithm specific arguments
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 3e-4
    """the learning rate of the Q network optimizer (and of alpha's), CleanRL's sac_atari.py's 3e-4
    (sac_continuous.py has sac_continuous_action.py's 1e-3)"""
    adam_eps: Optional[float] = None
    """the epsilon of the Adam optimizers (default: 1e-8 for vector observations, 1e-4 for images)"""
    update_frequency: Optional[int] = None
    """one critic, actor and alpha update every this many env steps (default: 1 for vectors, 4 for images), and at
    most one per vector step: with --num-envs above it, one per vector step"""
    tau: Optional[float] = None
    """target network smoothing coefficient (default: 0.005 for vector observations, 1.0, a hard copy, for images)"""
    target_network_frequency: Optional[int] = None
    """the frequency of the target update, in env steps (default: 1 for vector observations, 8000 for images)"""
    num_critics: int = 2
    """the number of Q networks; the target and the actor use their minimum"""
    alpha: float = 0.2
    """the entropy coefficient when --no-autotune"""
    autotune: bool = True
    """tune alpha automatically towards the target entropy (starting from alpha = 1)"""
    target_entropy_ratio: Optional[float] = None
    """target entropy as a fraction of the largest, log|A| (default: 0.7 for vector observations, see the docstring;
    CleanRL's sac_atari's 0.89 for images)"""
    machado: bool = False
    """Atari: train on whole games without FIRE on reset (Machado et al. 2018's protocol) instead of CleanRL's
    sac_atari wrappers (a lost life ends a training episode, FIRE after each reset); evaluation is the same either
    way, and other envs ignore it"""


# The defaults of the flags left at None: SAC's usual per-step updates for vectors, CleanRL's sac_atari for images.
OBSERVATION_DEFAULTS = {
    "vector": dict(total_timesteps=100_000, learning_starts=5000, batch_size=256, adam_eps=1e-8, update_frequency=1,
                   tau=0.005, target_network_frequency=1, target_entropy_ratio=0.7),
    "image": dict(total_timesteps=5_000_000, learning_starts=20_000, batch_size=64, adam_eps=1e-4, update_frequency=4,
                  tau=1.0, target_network_frequency=8000, target_entropy_ratio=0.89),
}


def is_atari(env_id):
    spec = gym.registry.get(env_id)
    return spec is not None and "ale_py" in str(spec.entry_point)


def make_env(env_id, render_mode=None, evaluation=False, machado=False):
    """An env; for Atari, CleanRL's sac_atari.py wrappers: 30 no-op starts, frame skip 4 with max-pooling, 84x84
    grey (AtariPreprocessing), in training a lost life ends an episode (EpisodicLife) and FIRE follows a reset
    (FireReset), 4 stacked frames; rewards are clipped in the loop. With `machado`, training keeps whole games and no
    FIRE (Machado et al. 2018's protocol); evaluation plays whole games and presses FIRE at each life's start."""

    def thunk():
        if not is_atari(env_id):
            return gym.make(env_id, render_mode=render_mode)
        env = gym.make(env_id, frameskip=1, render_mode=render_mode)  # AtariPreprocessing skips the frames
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84)
        fire = "FIRE" in env.unwrapped.get_action_meanings()
        if not evaluation and not machado:
            env = EpisodicLife(env)
            env = FireReset(env) if fire else env
        env = gym.wrappers.FrameStackObservation(env, 4)
        return FireOnLifeStart(env) if evaluation and fire else env

    return thunk


class EpisodicLife(gym.Wrapper):
    """Training (CleanRL's EpisodicLifeEnv): a lost life ends the episode (terminated, so no bootstrap) and the
    next reset continues the same game with a no-op step; only a game over resets the game. info["life_lost"] tells
    such an end from a game over, whose score is the one logged."""

    def __init__(self, env):
        super().__init__(env)
        self.lives, self.game_over = 0, True

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_over = terminated or truncated
        lives = self.env.unwrapped.ale.lives()
        info["life_lost"] = 0 < lives < self.lives and not self.game_over
        self.lives = lives
        return obs, reward, terminated or info["life_lost"], truncated, info

    def reset(self, **kwargs):
        if not self.game_over:  # a lost life: the same game goes on, after a no-op step
            obs, _, terminated, truncated, info = self.env.step(0)
        if self.game_over or terminated or truncated:
            obs, info = self.env.reset(**kwargs)
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """Training (CleanRL's FireResetEnv): after every reset, FIRE and then action 2, so that a game that needs FIRE
    to serve starts; the rewards of these two steps are dropped, as there."""

    def reset(self, **kwargs):
        self.env.reset(**kwargs)
        for action in (self.env.unwrapped.get_action_meanings().index("FIRE"), 2):
            obs, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        return obs, info


class FireOnLifeStart(gym.Wrapper):
    """Evaluation only: press FIRE at the start of every life, as CleanRL's FireResetEnv does at each reset, so that
    an argmax policy that never fires cannot stall a game that needs FIRE to serve (Breakout) until ALE's frame cap;
    the reward of those steps counts (a reset's, with the first step's)."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs, self.fire_reward, terminated, truncated, info = self.env.step(
            self.env.unwrapped.get_action_meanings().index("FIRE"))
        return self.reset(**kwargs) if terminated or truncated else (obs, info)

    def step(self, action):
        lives = self.env.unwrapped.ale.lives()
        obs, reward, terminated, truncated, info = self.env.step(action)
        reward, self.fire_reward = reward + self.fire_reward, 0.0
        if not (terminated or truncated) and self.env.unwrapped.ale.lives() < lives:
            obs, fire_reward, terminated, truncated, info = self.env.step(
                self.env.unwrapped.get_action_meanings().index("FIRE"))
            reward += fire_reward
        return obs, reward, terminated, truncated, info


def games_over(terminated, truncated, infos):
    """The envs whose game ended at this step: every episode's end but a lost life in Atari training (EpisodicLife),
    so that a training return is a whole game's score, as CleanRL logs it."""
    life_lost = infos.get("final_info", {}).get("life_lost", np.zeros(len(terminated), dtype=bool))
    return np.flatnonzero((terminated | truncated) & ~life_lost)


def network(obs_shape, n_out, hidden=256):
    """A policy or Q network with n_out outputs: for 4x84x84 frames the Nature-CNN (Mnih et al. 2015) and a 512-unit
    layer, initialised as CleanRL's sac_atari (Kaiming-normal weights, zero biases); for vectors a 256-256 ReLU MLP
    with PyTorch's default initialisation."""
    if len(obs_shape) == 1:
        return nn.Sequential(nn.Linear(obs_shape[0], hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                             nn.Linear(hidden, n_out))
    conv = nn.Sequential(nn.Conv2d(obs_shape[0], 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())
    conv_features = conv(torch.zeros(1, *obs_shape)).shape[1]  # 3136 for 4x84x84
    net = nn.Sequential(conv, nn.Linear(conv_features, 512), nn.ReLU(), nn.Linear(512, n_out))
    for layer in net.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(layer.weight)
            nn.init.zeros_(layer.bias)
    return net


def preprocess(obs):
    """Frames are stored as uint8 and scaled to [0, 1] here; vector observations pass unchanged."""
    return obs.float() / 255.0 if obs.dtype == torch.uint8 else obs


class Actor(nn.Module):
    """Categorical policy: logits of pi(.|s) over the actions."""

    def __init__(self, obs_shape, n_actions):
        super().__init__()
        self.net = network(obs_shape, n_actions)

    def forward(self, obs):
        """log pi(.|s), of shape (batch, n_actions)."""
        return torch.log_softmax(self.net(preprocess(obs)), -1)

    def mode(self, obs):
        """The deterministic action used in evaluation: the most probable one."""
        return self(obs).argmax(-1)


class Critic(nn.Module):
    """`num_q` Q-networks, each giving Q(s, .) for every action. forward returns shape (num_q, batch, n_actions)."""

    def __init__(self, obs_shape, n_actions, num_q=2):
        super().__init__()
        self.qs = nn.ModuleList(network(obs_shape, n_actions) for _ in range(num_q))

    def forward(self, obs):
        obs = preprocess(obs)
        return torch.stack([q(obs) for q in self.qs])


class ReplayBuffer:
    """Uniform replay in one preallocated float32 tensor on the training device. A row is [obs, action, reward,
    terminated, next_obs], written by slice from one asynchronous upload per vector step. A batch is gathered into
    `self.batch`, which stays in one place in memory (as a CUDA graph needs); the length is a device tensor too, so
    that sampling never reads a host number. Actions are stored as floats (exact for any action count below 2**24)."""

    def __init__(self, capacity, obs_dim, act_dim, batch_size, device):
        self.capacity, self.device, self.pos, self.full = capacity, device, 0, False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)
        self.batch = torch.zeros(batch_size, sum(self.split), device=device)
        self.length = torch.zeros((), dtype=torch.int64, device=device)

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs, done=None):
        """Store one row per env (`done`, the episodes' ends, only matters to FrameReplayBuffer)."""
        rows = np.concatenate([obs, action[:, None], reward[:, None], terminated[:, None], next_obs], 1)
        rows = upload(rows, self.device)
        first = min(len(rows), self.capacity - self.pos)  # the rows before the ring wraps around
        self.data[self.pos : self.pos + first] = rows[:first]
        self.data[: len(rows) - first] = rows[first:]
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity
        self.length.fill_(len(self))

    def sample(self):
        """obs, action, reward, terminated, next_obs of a uniform batch; reward and terminated of shape (batch, 1)."""
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device) % self.length
        self.batch.copy_(self.data[idx])
        return self.batch.split(self.split, dim=1)

    def state_dict(self):
        return {"data": self.data[: len(self)].to("cpu", copy=True), "pos": self.pos, "full": self.full}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.pos, self.full = state["pos"], state["full"]
        self.length.fill_(len(self))


class FrameReplayBuffer:
    """Uniform replay of stacked Atari frames that stores each frame once (uint8), so 1e6 transitions of 4x84x84
    take about 7 GB instead of 56. Each env has a ring of rows; a row holds the newest frame of an observation, how
    many steps into its episode it is (at most stack - 1), and, when an action was taken there, the action, reward
    and termination. A transition's observation is the frames of its row and the rows before it, the episode's first
    frame repeated before its start (as FrameStackObservation pads); its next observation is the same one row on:
    the next transition's row, or at an episode's end a row that holds only the final frame. The rings live on
    `storage` (the training device, or pinned host memory when it has no room); batches go to `device`."""

    def __init__(self, capacity, obs_shape, num_envs, batch_size, device, storage=None):
        storage = device if storage is None else storage
        self.stack, self.rows, self.batch_size, self.device = obs_shape[0], capacity // num_envs + 1, batch_size, device

        def zeros(dtype, *shape):
            return torch.zeros(num_envs, self.rows, *shape, dtype=dtype, device=storage,
                               pin_memory=storage.type == "cpu" and device.type == "cuda")

        self.fields = {"frame": zeros(torch.uint8, *obs_shape[1:]), "steps": zeros(torch.long),
                       "action": zeros(torch.long), "reward": zeros(torch.float32), "terminated": zeros(torch.float32),
                       "valid": zeros(torch.bool)}  # valid: the row starts a transition whose frames are all there
        self.pos = np.full(num_envs, -1)  # each env's row of its current observation
        self.steps = np.zeros(num_envs, dtype=np.int64)  # and how many steps into its episode that is
        self.new_episode = np.ones(num_envs, dtype=bool)

    def add(self, obs, action, reward, terminated, next_obs, done):
        """Store one vector step's transitions from one upload: its numbers (each env's row and next row, its steps
        into the episode there, kept on the host too, its action, reward and termination) and its frames, as bytes."""
        pos = np.where(self.new_episode, (self.pos + 1) % self.rows, self.pos)  # a reset observation: a new row
        steps = np.where(self.new_episode, 0, self.steps)
        self.pos = (pos + 1) % self.rows  # the next observation's newest frame: a row that starts no transition yet
        self.steps = np.minimum(steps + 1, self.stack - 1)
        self.new_episode = np.asarray(done, dtype=bool).copy()
        numbers = np.stack([np.arange(len(obs)), pos, self.pos, steps, self.steps, action, reward, terminated], 1)
        numbers = numbers.astype(np.float64)  # exact for these integers and float32s
        frames = np.stack([np.asarray(obs)[:, -1], np.asarray(next_obs)[:, -1]])
        packed = upload(np.concatenate([numbers.view(np.uint8).ravel(), frames.ravel()]), self.fields["frame"].device)
        numbers = packed[: numbers.nbytes].view(torch.float64).view(numbers.shape)
        frames = packed[numbers.nbytes :].view(frames.shape)
        env, pos, nxt, steps, next_steps, action = numbers[:, :6].long().unbind(1)
        f = self.fields
        f["frame"][env, pos] = frames[0]  # the frame already there, unless the observation starts an episode
        f["frame"][env, nxt] = frames[1]
        f["steps"][env, pos] = steps
        f["steps"][env, nxt] = next_steps
        f["action"][env, pos] = action
        f["reward"][env, pos] = numbers[:, 6].float()
        f["terminated"][env, pos] = numbers[:, 7].float()
        f["valid"][env, pos] = torch.ones_like(pos, dtype=torch.bool)  # (a device tensor: a Python bool would wait)
        # The rows whose frames reach back to the next row (the oldest of the ring) cannot be sampled any more.
        stale = (nxt[:, None] + torch.arange(self.stack, device=nxt.device)) % self.rows
        f["valid"][env[:, None], stale] = torch.zeros_like(stale, dtype=torch.bool)

    def frames(self, env, row):
        """The stacked observation whose newest frame is at `row`: (batch, stack, H, W)."""
        back = torch.arange(self.stack - 1, -1, -1, device=row.device)
        rows = (row[:, None] - torch.minimum(back, self.fields["steps"][env, row][:, None])) % self.rows
        return self.fields["frame"][env[:, None], rows]

    def sample(self):
        """obs, action, reward, terminated, next_obs, as ReplayBuffer.sample."""
        # Uniform over the valid rows, exactly and deterministically: an integer draw modulo their count, found in
        # their running count by a binary search.
        count = torch.cumsum(self.fields["valid"].flatten(), 0)
        draws = torch.randint(0, 2**62, (self.batch_size,), device=count.device) % count[-1]
        flat = torch.searchsorted(count, draws, right=True)
        env, row = flat // self.rows, flat % self.rows
        f = self.fields
        batch = [self.frames(env, row), f["action"][env, row], f["reward"][env, row][:, None],
                 f["terminated"][env, row][:, None], self.frames(env, (row + 1) % self.rows)]
        return [x.to(self.device, non_blocking=True) for x in batch]

    def state_dict(self):
        """The whole rings (their unwritten rows are zeros); a resumed run starts new episodes, as Atari's envs'
        state is not restored."""
        return {**{name: field.to("cpu", copy=True) for name, field in self.fields.items()}, "pos": self.pos.copy()}

    def load_state_dict(self, state):
        for name, field in self.fields.items():
            field.copy_(state[name])
        self.pos, self.new_episode = state["pos"].copy(), np.ones(len(self.pos), dtype=bool)


def td_target(reward, terminated, next_q, next_log_pi, alpha, gamma):
    """y = r + gamma * (1 - terminated) * sum_a' pi(a'|s') (min_i Q'_i(s', a') - alpha * log pi(a'|s')): the
    expectation over the next action is exact; only a true termination stops the bootstrap."""
    next_v = (next_log_pi.exp() * (next_q - alpha * next_log_pi)).sum(-1, keepdim=True)
    return reward + gamma * (1.0 - terminated) * next_v


def soft_update(target, source, tau):
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def update_critic(batch, actor, qf, qf_target, q_optimizer, alpha, args):
    """One step on the critics' summed MSE; returns each critic's loss and mean Q values."""
    obs, action, reward, terminated, next_obs = batch
    with torch.no_grad():
        next_q = qf_target(next_obs).min(0).values
        target = td_target(reward, terminated, next_q, actor(next_obs), alpha, args.gamma)
    # Q_i(s, a_taken), (num_q, batch, 1), as a one-hot multiply-and-sum: exactly gather's values and gradients, but
    # with no scatter in the backward pass, which torch releases of 2024 could not capture in a CUDA graph.
    q = qf(obs)
    taken = (action.view(-1, 1) == torch.arange(q.shape[-1], device=q.device)).to(q.dtype)  # (batch, n_actions)
    q = (q * taken).sum(-1, keepdim=True)
    qf_losses = ((q - target) ** 2).mean((1, 2))  # each critic's
    qf_loss = qf_losses.sum()
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    q_optimizer.step()
    return qf_losses.detach(), q.detach().mean((1, 2))


def update_actor(obs, actor, qf, actor_optimizer, alpha):
    """Actor loss mean_s sum_a pi(a|s) (alpha * log pi(a|s) - min_i Q_i(s, a)); returns the loss and the policy's
    entropy at each state, which the alpha update uses."""
    with torch.no_grad():
        q = qf(obs).min(0).values
    log_pi = actor(obs)
    actor_loss = (log_pi.exp() * (alpha * log_pi - q)).sum(-1).mean()
    actor_optimizer.zero_grad(set_to_none=True)
    actor_loss.backward()
    actor_optimizer.step()
    return actor_loss.detach(), -(log_pi.exp() * log_pi).sum(-1).detach()


def update_alpha(entropy, log_alpha, alpha_optimizer, target_entropy):
    """alpha loss mean(-alpha * (target_entropy - entropy)), alpha = exp(log_alpha): alpha grows while the policy's
    entropy is below the target, and shrinks while it is above."""
    alpha_loss = (-log_alpha.exp() * (target_entropy - entropy)).mean()
    alpha_optimizer.zero_grad(set_to_none=True)
    alpha_loss.backward()
    alpha_optimizer.step()
    return alpha_loss.detach()

def update(rb, actor, qf, qf_target, q_optimizer, actor_optimizer, log_alpha, alpha_optimizer, target_entropy, args):
    """One update on a new batch: the critics, the actor, then alpha (with --autotune). Returns the losses, the
    critics' mean Q values and the policy's mean entropy."""
    batch = rb.sample()
    alpha = log_alpha.exp().detach()
    qf_losses, qf_values = update_critic(batch, actor, qf, qf_target, q_optimizer, alpha, args)
    actor_loss, entropy = update_actor(batch[0], actor, qf, actor_optimizer, alpha)
    alpha_loss = (update_alpha(entropy, log_alpha, alpha_optimizer, target_entropy) if args.autotune
                  else torch.zeros((), device=alpha.device))
    return qf_losses, qf_values, actor_loss, alpha_loss, entropy.mean()


def upload(array, device):
    """A host array as a tensor on `device`, without waiting for a GPU: copied from pinned memory, asynchronously
    (later work on the device is ordered after the copy). Frames stay uint8 (the networks scale them), anything
    else becomes float32."""
    array = np.asarray(array)
    tensor = torch.as_tensor(array, dtype=torch.uint8 if array.dtype == np.uint8 else torch.float32)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor


def true_next_obs(next_obs, infos):
    """Same-step autoreset: next_obs of a finished env is already the next episode's first observation; the
    transition must store the true final one."""
    real_next_obs = next_obs.copy()
    for i in np.flatnonzero(infos.get("_final_obs", [])):
        real_next_obs[i] = infos["final_obs"][i]
    return real_next_obs


def crossed(step, freq, step_size):
    """True when the last step_size steps, ending at step, crossed a multiple of freq (never when freq is 0)."""
    return freq > 0 and step // freq != (step - step_size) // freq


def main(args):
    observations = "image" if is_atari(args.env_id) else "vector"
    args = replace(args, **{name: value for name, value in OBSERVATION_DEFAULTS[observations].items()
                            if getattr(args, name) is None})
    check_args(args)
    checkpoint = args.resume and read_checkpoint(args.resume, args)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the random actions before learning starts

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, machado=args.machado) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_shape, n_actions = envs.single_observation_space.shape, int(envs.single_action_space.n)
    # The replay's rows: frames stored once (a byte a pixel and 25 bytes beside), or vectors of float32.
    frame_bytes = (args.buffer_size + args.num_envs) * (int(np.prod(obs_shape[1:])) + 25)
    vector_bytes = (args.buffer_size + args.batch_size) * (2 * obs_shape[0] + 3) * 4
    device, storage = choose_device(args, frame_bytes if observations == "image" else vector_bytes,
                                    frames=observations == "image")

    actor = Actor(obs_shape, n_actions).to(device)
    qf = Critic(obs_shape, n_actions, num_q=args.num_critics).to(device)
    qf_target = Critic(obs_shape, n_actions, num_q=args.num_critics).to(device)
    qf_target.load_state_dict(qf.state_dict())
    log_alpha = torch.tensor(float(np.log(1.0 if args.autotune else args.alpha)), device=device, requires_grad=True)
    target_entropy = args.target_entropy_ratio * float(np.log(n_actions))
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    adam = partial(torch.optim.Adam, eps=args.adam_eps, fused=True, capturable=args.cudagraphs)
    actor_optimizer = adam(actor.parameters(), lr=args.policy_lr)
    q_optimizer = adam(qf.parameters(), lr=args.q_lr)
    alpha_optimizer = adam([log_alpha], lr=args.q_lr)
    if observations == "image":  # frames stored once
        rb = FrameReplayBuffer(args.buffer_size, obs_shape, args.num_envs, args.batch_size, device, storage)
    else:
        rb = ReplayBuffer(args.buffer_size, obs_shape[0], 1, args.batch_size, device)
    # The updates as callables without arguments, compiled or captured as CUDA graphs under the flags.
    update_step = accelerate(partial(update, rb, actor, qf, qf_target, q_optimizer, actor_optimizer, log_alpha,
                                     alpha_optimizer, target_entropy, args), args)
    target_step = accelerate(partial(soft_update, qf_target, qf, args.tau), args)
    # Everything a checkpoint holds besides the loop's counters and the envs: --resume restores exactly these.
    state = {"actor": actor, "qf": qf, "qf_target": qf_target, "actor_optimizer": actor_optimizer,
             "q_optimizer": q_optimizer, "alpha_optimizer": alpha_optimizer, "rb": rb, "rng": rng,
             "log_alpha": nn.ParameterList([log_alpha])}  # a module that shares the tensor (saved, loaded in place)

    obs, _ = envs.reset(seed=args.seed)
    start = {"global_step": 0, "num_updates": 0, "obs": obs, "episode_return": np.zeros(args.num_envs),
             "episode_length": np.zeros(args.num_envs, dtype=np.int64)}
    loop = restore(checkpoint, state, envs.envs, start) if checkpoint else start
    global_step, num_updates = loop["global_step"], loop["num_updates"]
    obs, episode_return, episode_length = loop["obs"], loop["episode_return"], loop["episode_length"]
    obs_on_device = upload(obs, device)
    run = Run(args, checkpoint, device)
    try:
        if run.evaluation_due:  # the checkpoint's evaluation, which a signal interrupted
            run.evaluate_and_log(global_step, actor.mode)
            run.exit_on_signal(global_step)  # the checkpoint resumed from still holds it all
        while global_step < args.total_timesteps:
            if global_step < args.learning_starts:
                action = rng.integers(0, n_actions, args.num_envs)
            else:
                with torch.no_grad():
                    log_pi = actor(obs_on_device)
                    finite = torch.isfinite(log_pi).all(-1)  # travels with the action: one copy, checked on the host
                    action = torch.distributions.Categorical(logits=log_pi.where(finite[:, None], 0.0),
                                                             validate_args=False).sample()
                    action, finite = torch.stack([action, finite.long()]).cpu().numpy()
                if not finite.all():
                    run.stop_on(f"non-finite policy at global_step {global_step}")
            next_obs, reward, terminated, truncated, infos = envs.step(action)
            global_step += args.num_envs
            run.metrics.check_finite(global_step, reward=reward, observation=next_obs)

            episode_return += reward
            episode_length += 1
            for i in games_over(terminated, truncated, infos):  # (a lost life ends an Atari episode, not a game)
                run.metrics.writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                run.metrics.writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                episode_return[i] = 0.0
                episode_length[i] = 0

            # Atari trains on rewards clipped to their sign (as CleanRL); returns are logged unclipped.
            rb.add(obs, action, np.sign(reward) if observations == "image" else reward, terminated,
                   true_next_obs(next_obs, infos), terminated | truncated)
            obs, obs_on_device = next_obs, upload(next_obs, device)

            if global_step > args.learning_starts and crossed(global_step, args.update_frequency, args.num_envs):
                qf_losses, qf_values, actor_loss, alpha_loss, entropy = update_step()
                num_updates += 1
                run.metrics.record(global_step, num_updates, qf_loss=qf_losses.mean(), qf1_loss=qf_losses[0],
                           qf2_loss=qf_losses[1], actor_loss=actor_loss, alpha_loss=alpha_loss,
                           alpha=log_alpha.exp().detach(), entropy=entropy, qf1_values=qf_values[0],
                           qf2_values=qf_values[1])
            if global_step > args.learning_starts and crossed(global_step, args.target_network_frequency,
                                                              args.num_envs):
                target_step()  # with --tau 1, a hard copy

            run.progress.update(global_step, num_updates)
            done = global_step >= args.total_timesteps
            if crossed(global_step, args.eval_freq, args.num_envs) or done:
                run.evaluate_and_log(global_step, actor.mode)
            if run.signal or (done and args.checkpoint_freq) or crossed(global_step, args.checkpoint_freq,
                                                                         args.num_envs):
                run.save_checkpoint(state, envs.envs, global_step=global_step, num_updates=num_updates, obs=obs,
                                    episode_return=episode_return, episode_length=episode_length)
                run.exit_on_signal(global_step)
        if args.save_model:  # the final networks, on the CPU, and the arguments
            model = {"actor": actor.cpu().state_dict(), "qf": qf.cpu().state_dict(), "args": asdict(args)}
            write_atomically(f"{run.dir}/model.pt", partial(torch.save, model), mode="wb")
        run.finished = True
    finally:
        envs.close()
        run.close()
    return run.result


# ======================================================================================================================
# Part 2: the run machinery. Nothing below changes what is computed: it checks the input before anything is written,
# owns the run's directory (one writer, files written whole), evaluates, and stops on a non-finite number or a signal.
# ======================================================================================================================

# Flags a resume may change: they change how a run is watched, not what it computes.
WATCH_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video"}
WATCH_FLAGS |= {"save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def fail(message, error=None):
    """Stop with one line on stderr (above a progress bar), `error`'s first line after the message, and exit 1."""
    words = (str(error).splitlines() or [type(error).__name__])[0] if error is not None else ""
    tqdm.write(f"error: {message}" + f": {words}" * bool(words), file=sys.stderr)
    sys.exit(1)


def exit_outside_the_run(signum, frame):
    """A signal before the run has its directory or after its files are written: one line, no cleanup to interrupt."""
    with contextlib.suppress(OSError):  # stderr gone with its terminal (SIGHUP): the exit still comes
        print(f"{signal.Signals(signum).name} outside the run: nothing to save", file=sys.stderr)
    os._exit(128 + signum)


def check_args(args):
    """One line unless the numeric flags are finite and in range, the flags agree and --env-id names one version of an
    env this script can learn (and record, with video)."""
    positive = ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq", "tau"]
    positive += ["adam_eps", "update_frequency", "target_network_frequency", "policy_lr", "q_lr", "alpha"]
    for name, value in asdict(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not np.isfinite(value):
            fail(f"{flag} must be a finite number, got {value}")
        if isinstance(value, (int, float)) and (value <= 0 if name in positive else value < 0):
            fail(f"{flag} must be {'positive' if name in positive else 'non-negative'}, got {value}")
        if name in ["gamma", "tau"] and not 0 <= value <= 1:
            fail(f"{flag} must lie in [0, 1], got {value}")
    # An --env-id without a version: gymnasium would run the latest silently, in a directory not saying which.
    versions = sorted(i for i in gym.registry if i.rsplit("-v", 1)[0] == args.env_id)
    problems = {
        f"--env-id {args.env_id} names no version; gymnasium has {', '.join(versions)}": bool(versions),
        f"--seed must lie in [0, 2**31), got {args.seed}": not 0 <= args.seed < 2**31,
        "--eval-episodes must be at most 1000": args.eval_episodes > 1000,
        f"--num-critics must be at least 2, got {args.num_critics}": args.num_critics < 2,
        "--target-entropy-ratio must lie in (0, 1)": not 0 < args.target_entropy_ratio < 1,
        f"--batch-size {args.batch_size} is larger than --buffer-size": args.batch_size > args.buffer_size,
        "--learning-starts must be below --total-timesteps": args.learning_starts >= args.total_timesteps,
        f"--exp-name {args.exp_name!r} must be a plain file name of 1-100 characters": not (
            0 < len(args.exp_name) <= 100 and "/" not in args.exp_name and not args.exp_name.startswith(".")),
        "--resume needs the path of a checkpoint.pt": args.resume == "",
        "--track needs wandb: pip install wandb": args.track and not importlib.util.find_spec("wandb"),
    }
    for message in (message for message, problem in problems.items() if problem):
        fail(message)
    # Nothing renders without --capture-video: no render backend (MUJOCO_GL) may stop the run.
    os.environ["MUJOCO_GL"] = os.environ.get("MUJOCO_GL", "egl") if args.capture_video else "disable"
    # MuJoCo 4 warns at each load of HalfCheetah-v4 that "'settotalmass' is deprecated", also into ./MUJOCO_LOG.TXT:
    with contextlib.suppress(Exception):  # that one is dropped, any other goes to stderr (no mujoco: said below)
        importlib.import_module("mujoco").set_mju_user_warning(
            lambda text: "'settotalmass' is deprecated" in text or print(f"WARNING: {text}", file=sys.stderr))
    try:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        env = make_env(args.env_id, render_mode="rgb_array" if args.capture_video else None)()
        if args.capture_video:  # once here, as RecordVideo will: moviepy to write a frame, and a frame
            importlib.import_module("moviepy")
            env.reset(seed=0)
            env.render()
    except Exception as e:
        if args.capture_video and args.env_id in gym.registry:  # most likely a failing render backend, or no moviepy
            fail(f"--capture-video cannot record {args.env_id} (MUJOCO_GL={os.environ['MUJOCO_GL']})", e)
        fail(f"cannot make --env-id {args.env_id!r}" + (" (Atari: pip install ale-py)" if ale_py is None else ""), e)
    obs_space, act_space = env.observation_space, env.action_space
    if not isinstance(act_space, gym.spaces.Discrete) or act_space.start != 0:
        fail(f"{args.env_id} has actions {act_space}; SAC here needs Discrete ones from 0 (Box: sac_continuous.py)")
    if not (isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1 or is_atari(args.env_id)):
        fail(f"{args.env_id} has {obs_space} observations; this script needs a flat vector or an Atari game")
    env.close()


def read_checkpoint(path, args=None):
    """This script's checkpoint.pt at `path`, or one line why not; with `args`: same algorithm flags, steps left."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:
        fail(f"cannot read --resume file {path}", e)
    if not isinstance(checkpoint, dict) or not {"args", "loop", "state", "run"} <= checkpoint.keys():
        fail(f"--resume file {path} is not a checkpoint.pt of this script (model.pt holds only the networks)")
    if checkpoint.get("script") != os.path.basename(__file__):
        made = checkpoint.get("script", "an older version of this script")
        fail(f"--resume file {path} was made by {made}, not {os.path.basename(__file__)}")
    for name, value in asdict(args).items() if args else ():
        if name not in WATCH_FLAGS and (made := checkpoint["args"].get(name)) != value:
            fail(f"--resume file {path} was made with --{name.replace('_', '-')} {made}, not {value}")
    step = checkpoint["loop"]["global_step"]
    if args and args.total_timesteps <= step and not checkpoint["run"]["evaluation_due"]:
        fail(f"--total-timesteps {args.total_timesteps} is not beyond the checkpoint's global_step {step}")
    return checkpoint


def restore(checkpoint, state, envs, start):
    """Load a checkpoint into `state`, the envs and RNGs and return the loop's values; one line if it does not fit."""
    try:
        for name, value in state.items():
            if isinstance(value, np.random.Generator):
                value.bit_generator.state = checkpoint["state"][name]
            else:
                value.load_state_dict(checkpoint["state"][name])
        loop = {name: checkpoint["loop"][name] for name in start}
        if all("mujoco" in saved or "state" in saved for saved in checkpoint["envs"]):
            for env, saved in zip(envs, checkpoint["envs"], strict=True):
                set_env_state(env, saved)
        else:  # an env whose state this script cannot read: new episodes, from the reset in `start`
            print("warning: cannot restore the envs' state; the resumed run starts new episodes", file=sys.stderr)
            loop.update({name: start[name] for name in ("obs", "episode_return", "episode_length")})
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(checkpoint["rng"]["cuda"])
        return loop
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        fail("the --resume checkpoint does not fit this run", e)


def choose_device(args, buffer_bytes, frames=False):
    """The training device (a warning line when --cuda finds no GPU) and the replay buffer's: Atari `frames` go to
    pinned host memory when the GPU has no room; one line unless it fits there and (a checkpoint's copy) the host's."""
    if args.cuda and not torch.cuda.is_available():
        print("warning: no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    args.cudagraphs = args.cudagraphs and device.type == "cuda" and not frames  # as it runs (args.json, the checkpoint)
    if device.type == "cuda" and args.torch_deterministic:  # the CPU's ops are deterministic already
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition, before its first use
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that has no such version
    free = {"cpu": int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024}
    free["cuda"] = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    need = {"cuda": buffer_bytes, "cpu": buffer_bytes} if device.type == "cuda" else {"cpu": 2 * buffer_bytes}
    if frames and device.type == "cuda" and need["cuda"] > free["cuda"] and 3 * buffer_bytes <= free["cpu"]:
        return device, torch.device("cpu")  # (pinned memory rounds up to a power of two bytes: twice at most)
    for kind in (kind for kind in need if need[kind] > free[kind]):
        fail(f"the replay buffer needs {need[kind] / 2**30:.1f} GiB, more than the {free[kind] / 2**30:.1f} GiB "
             f"free on the {kind}; lower --buffer-size or --batch-size")
    return device, device


class Threads:
    """--torch-threads 0 (benchmark/results/threads.md): every 2 s, as many threads as the CPUs others left idle."""

    def __init__(self):
        self.most, self.rising, self.last = torch.get_num_threads(), False, self.reading()
        self.checked = time.monotonic()
        torch.set_num_threads(1)

    def reading(self):  # (time, CPU seconds others used of this process's CPUs, its CPUs), or None (no /proc/stat)
        with contextlib.suppress(OSError, AttributeError, ValueError):
            cpus, stat = os.sched_getaffinity(0), [line.split() for line in open("/proc/stat")]  # "cpuN" and ticks
            busy = [sum(map(int, t[:8])) - int(t[3]) - int(t[4]) for n, *t in stat if n[3:] in map(str, cpus)]
            return time.monotonic(), sum(busy) / os.sysconf("SC_CLK_TCK") - sum(os.times()[:2]), len(cpus)

    def choose(self):
        now, was, threads = self.reading(), self.last, torch.get_num_threads()
        idle = now[2] - max(now[1] - was[1], 0.0) / max(now[0] - was[0], 1e-3) if now and was else 1
        fits = max(1, min(self.most, int(idle + 0.2)))  # (a core a fifth used is busy)
        torch.set_num_threads(fits if fits < threads or self.rising else threads)  # fewer at once, more when two say
        self.rising, self.last, self.checked = fits > torch.get_num_threads(), now, time.monotonic()


def accelerate(step, args):
    """An update step (a callable without arguments) as it is, torch.compile'd, and/or replayed as a CUDA graph."""
    step = torch.compile(step) if args.compile else step
    return CudaGraph(step) if args.cudagraphs else step


class CudaGraph:
    """--cudagraphs: `step` run eagerly, captured once, then replayed; its tensors stay in place, outputs are reused."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph = step, warmup, None

    def __call__(self):
        if self.warmup:
            self.warmup, stream = self.warmup - 1, torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outputs = self.step()
            torch.cuda.current_stream().wait_stream(stream)
            return outputs
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.step()
        self.graph.replay()
        return self.outputs


def env_state(env):
    """What it takes to continue one env's episode bit for bit: its RNG, time-limit counter and physics."""
    u, state = env.unwrapped, {"np_random": env.unwrapped.np_random.bit_generator.state}
    with contextlib.suppress(AttributeError):  # an env without a time limit has no counter
        state["elapsed_steps"] = env.get_wrapper_attr("_elapsed_steps")
    if hasattr(u, "model") and hasattr(u, "data"):  # MuJoCo: the full integration state, warm-start included
        import mujoco
        state["mujoco"] = np.empty(mujoco.mj_stateSize(u.model, mujoco.mjtState.mjSTATE_INTEGRATION))
        mujoco.mj_getState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
    elif hasattr(u, "state"):  # classic control
        state["state"] = np.array(u.state)
    return state


def set_env_state(env, state):
    u = env.unwrapped
    u.np_random.bit_generator.state = state["np_random"]
    if "elapsed_steps" in state:
        env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
    if "mujoco" in state:
        import mujoco
        mujoco.mj_setState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(u.model, u.data)
    elif "state" in state:
        u.state = state["state"]


def evaluate(policy, env_id, episodes, seed, device, stop, video_folder=None, video_prefix="eval"):
    """Returns of `episodes` full episodes of the deterministic `policy`, on a separate env; None once `stop()`."""
    env = make_env(env_id, render_mode="rgb_array" if video_folder else None, evaluation=True)()
    if env.spec.max_episode_steps is None and not is_atari(env_id):  # ALE ends an episode at 108,000 frames itself
        env = gym.wrappers.TimeLimit(env, 10_000)  # an env without a time limit (MuJoCo's is 1,000 steps)
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda e: e == 0, name_prefix=video_prefix)
    returns = []
    try:
        for episode in range(episodes):
            (obs, _), done, episode_return = env.reset(seed=seed + episode), False, 0.0
            while not done:
                if stop():
                    return None
                with torch.no_grad():
                    action = policy(upload(obs[None], device))[0].item()  # the one wait per step
                obs, reward, terminated, truncated, _ = env.step(action)
                episode_return, done = episode_return + float(reward), terminated or truncated
            returns.append(episode_return)
    finally:
        env.close()
    return returns


def write_atomically(path, write, mode="w"):
    """`path` whole or not at all (path.tmp, synced, renamed); a failed write (a full disk): one line, old file kept."""
    try:
        with open(path + ".tmp", mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a crash cannot leave an empty file under the name
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its own words
        full = shutil.disk_usage(os.path.dirname(path)).free < 2**20  # read while the temp file holds its space
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        fail(f"cannot write {path}", "no space left" if full else getattr(e, "strerror", None) or e)


def claim_run_dir(args):
    """runs/{run_name} made (-2, -3, ... if taken) or --resume's, locked by a file naming this process: one writer."""
    name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    path = os.path.dirname(os.path.abspath(args.resume)) if args.resume else os.path.abspath(os.path.join("runs", name))
    try:
        for path in [path] if args.resume else [path + f"-{n}" * (n > 1) for n in range(1, 1000)]:
            with contextlib.suppress(FileExistsError):  # (mkdir is atomic: of runs started together, one takes a name)
                os.makedirs(path, exist_ok=bool(args.resume))
                break
        lock = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"{path} is in use by {os.read(lock, 100).decode() or 'another process'}")
    except OSError as e:
        fail(f"cannot create the run directory {path}", e.strerror)
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return path, lock


class Metrics:
    """TensorBoard (and W&B); the updates' metrics summed on the device, checked and logged (one wait) at log points."""

    def __init__(self, args, path, device, stop, purge_step=None, names=(), sum=None, count=0, window=(0, 0, 0, 0)):
        self.args, self.stop, self.names, self.count, self.window = args, stop, list(names), count, list(window)
        self.sum, self.sps_start = None if sum is None else sum.to(device), None  # (this process's first update)
        if args.track:  # W&B syncing the TensorBoard files (started before the writer), or one line saying why not
            name = os.path.basename(path)
            try:
                importlib.import_module("wandb").init(
                    project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, dir=path,
                    resume="allow", config=asdict(args), name=name, id=name[-64:].replace(".", "-"))
            except Exception as e:  # no key, a key wandb refuses, no server, an unknown entity
                fail("--track: wandb cannot start (wandb login, or WANDB_MODE=offline)", e)
        self.writer = SummaryWriter(path, purge_step=purge_step)  # points after it, of the run resumed, are dropped

    def record(self, global_step, update, **metrics):
        """Add one update's metrics (scalar tensors, on the device); log them every --log-freq updates."""
        self.sps_start = self.sps_start or (global_step, time.time())
        self.names, self.sum = list(metrics), torch.stack(list(metrics.values())) + (self.sum if self.count else 0)
        self.window = [update, global_step] * 2 if not self.count else self.window[:2] + [update, global_step]
        self.count += 1
        if self.count == self.args.log_freq:
            self.log(global_step)

    def means(self):
        """The means since the last log; the run stops on a non-finite one, naming it and its window."""
        means = dict(zip(self.names, (self.sum / self.count).tolist())) if self.count else {}
        for name in (name for name, value in means.items() if not np.isfinite(value)):
            self.stop("non-finite {} in updates {}-{}, from global_step {} to {}".format(name, *self.window[::2],
                                                                                         *self.window[1::2]))
        return means

    def log(self, global_step):
        """Log the means since the last log and the env steps/s of this process."""
        for name, value in self.means().items():
            self.writer.add_scalar(f"losses/{name}", value, global_step)
        if self.count and self.sps_start:  # (a resumed run's carried metrics come before this process's first update)
            sps = (global_step - self.sps_start[0]) / max(time.time() - self.sps_start[1], 1e-9)
            self.writer.add_scalar("charts/SPS", int(sps), global_step)
        self.count = 0

    def check_finite(self, global_step, **arrays):
        """Stop if a host array (an action, a reward, an observation) is not finite, naming it, before it is used."""
        for name in (name for name, array in arrays.items() if not np.isfinite(array).all()):
            self.stop(f"non-finite {name} at global_step {global_step}")


class Progress:
    """tqdm's bar (in a log, a line a minute), its ETA from the first update; torch's threads (0: `Threads`' rule)."""

    def __init__(self, args, global_step, num_updates, last_eval):
        self.tty, self.first, self.checked = sys.stdout.isatty(), None, time.monotonic()
        torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # (0: as the rule chooses, from one)
        self.threads = None if args.torch_threads else Threads()
        self.steps, self.updates, self.first_updates, self.last_eval = global_step, num_updates, num_updates, last_eval
        lines = types.SimpleNamespace(write=lambda s: s.strip() and print(s.strip(), flush=True), flush=lambda: None)
        self.bar = tqdm(total=args.total_timesteps, initial=global_step, dynamic_ncols=True, miniters=1,
                        mininterval=1 if self.tty else 60, delay=1 if self.tty else 60, postfix="ETA ?",
                        file=sys.stdout if self.tty else lines,  # in a log: a line each time, no carriage returns
                        bar_format="{percentage:3.0f}%|{bar}| {n}/{total} steps{postfix}")  # tqdm: ", " + postfix

    def update(self, global_step, num_updates):
        now = time.monotonic()
        if num_updates > self.first_updates and not self.first:  # the first update: the ETA is timed from here
            self.first = global_step, now
        if self.threads and now - self.threads.checked >= 2:
            self.threads.choose()
        if now - self.checked >= self.bar.mininterval:  # the speeds since the last time, shown until the next
            threads, elapsed, (step, start) = torch.get_num_threads(), now - self.checked, self.first or (0, now)
            sps, ups = (global_step - self.steps) / elapsed, (num_updates - self.updates) / elapsed
            eta = tqdm.format_interval((self.bar.total - global_step) * (now - start) / max(global_step - step, 1))
            self.bar.set_postfix_str(f"ETA {eta if now > start else '?'}, {sps:.0f} steps/s, {ups:.0f} updates/s, "
                                     f"last eval {self.last_eval}, {threads} thread{'s' * (threads > 1)}", False)
            self.steps, self.updates, self.checked = global_step, num_updates, now
        self.bar.update(global_step - self.bar.n)

    def say(self, line, file=None):
        """A line of its own (on stdout unless `file`); on a terminal above the bar."""
        with contextlib.suppress(OSError):  # a terminal gone (SIGHUP) cannot stop the run from saving and ending
            tqdm.write(line, file=file or sys.stdout) if self.tty else print(line, file=file or sys.stdout, flush=True)


class Run:
    """A run's directory, files, evaluations, checkpoints and signals (a flag, which the loop and evaluations poll)."""

    def __init__(self, args, checkpoint, device):
        self.args, self.device, self.signal, self.finished, self.result = args, device, None, False, None
        self.handlers = {s: signal.signal(s, lambda signum, frame: setattr(self, "signal", signum)) for s in SIGNALS}
        self.dir, self.lock = claim_run_dir(args)
        saved = checkpoint["run"] if checkpoint else {"wall_time": 0, "evaluations": [], "evaluation_due": False}
        self.evaluations, self.evaluation_due = saved["evaluations"], saved["evaluation_due"]  # rows of the csv
        self.start_time = time.time() - saved["wall_time"]
        write_atomically(f"{self.dir}/args.json", lambda f: json.dump({**asdict(args), "device": str(device)}, f))
        self.write_evaluations()  # on resume: the rows up to the checkpoint, dropping any made after it
        loop = checkpoint["loop"] if checkpoint else {"global_step": 0, "num_updates": 0}
        purge_step = loop["global_step"] + 1 if checkpoint else None
        self.metrics = Metrics(args, self.dir, device, self.stop_on, purge_step, **saved.get("metrics", {}))
        last_eval = "{2:.1f} +- {3:.1f}".format(*self.evaluations[-1]) if self.evaluations else "-"
        self.progress = Progress(args, loop["global_step"], loop["num_updates"], last_eval)
        start = f"resumed {self.dir} at global_step {loop['global_step']}" if checkpoint else f"run {self.dir}"
        how = " ".join(["compiled"] * args.compile + ["as CUDA graphs"] * args.cudagraphs) or "eager"
        self.progress.say(f"{start}: {args.env_id}, {args.total_timesteps} steps on {device}, updates {how}")

    def stop_on(self, cause):
        last = f"{self.dir}/checkpoint.pt" if os.path.exists(f"{self.dir}/checkpoint.pt") else "none"
        fail(f"{cause}; stopping. Last checkpoint: {last}")

    def evaluate_and_log(self, global_step, policy):
        """Evaluate `policy` into evaluations.csv and TensorBoard; a signal ends it at once, leaving it due."""
        self.metrics.log(global_step)
        self.evaluation_due = True
        video_folder = os.path.join("videos", os.path.basename(self.dir)) if self.args.capture_video else None
        returns = evaluate(policy, self.args.env_id, self.args.eval_episodes, self.args.seed + 100_000, self.device,
                           lambda: self.signal, video_folder, video_prefix=f"step-{global_step}")
        if returns is None:
            return
        mean, std, self.evaluation_due = float(np.mean(returns)), float(np.std(returns)), False
        self.metrics.writer.add_scalar("eval/episodic_return", mean, global_step)
        wall_time = round(time.time() - self.start_time, 1)
        self.evaluations.append([global_step, wall_time, mean, std, " ".join(f"{r:.2f}" for r in returns)])
        self.write_evaluations()
        self.result = {"run_dir": self.dir, "global_step": global_step, "eval_mean": mean, "eval_std": std}
        self.progress.last_eval = f"{mean:.1f} +- {std:.1f}"
        self.progress.say(f"step {global_step}/{self.args.total_timesteps} | eval return {self.progress.last_eval}")

    def write_evaluations(self):
        rows = [["global_step", "wall_time_s", "mean_return", "std_return", "returns"], *self.evaluations]
        write_atomically(f"{self.dir}/evaluations.csv", lambda f: csv.writer(f).writerows(rows))

    def save_checkpoint(self, state, envs, **loop):
        """Write `state`, the envs, every RNG, the loop's values by name, the evaluations and metrics (checked)."""
        self.metrics.means()
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        metrics = {k: getattr(self.metrics, k) for k in ("names", "sum", "count", "window")}  # as Metrics takes them
        run = {"wall_time": time.time() - self.start_time, "evaluations": self.evaluations,
               "evaluation_due": self.evaluation_due, "metrics": metrics}
        state = {k: v.bit_generator.state if hasattr(v, "bit_generator") else v.state_dict() for k, v in state.items()}
        checkpoint = {"script": os.path.basename(__file__), "args": asdict(self.args), "loop": loop, "run": run,
                      "state": state, "envs": [env_state(env) for env in envs], "rng": rng}
        write_atomically(f"{self.dir}/checkpoint.pt", partial(torch.save, checkpoint), mode="wb")

    def exit_on_signal(self, global_step):
        """After a signal an unfinished run ends here with one line and 128 + signal (a finished one, in close)."""
        if self.signal and (global_step < self.args.total_timesteps or self.evaluation_due):
            self.progress.say(f"{signal.Signals(self.signal).name} at global_step {global_step}: checkpoint written; "
                              f"continue with --resume {self.dir}/checkpoint.pt", sys.stderr)
            sys.exit(128 + self.signal)

    def close(self):
        """A finished run's closing line; the files closed, the lock removed, the signals given back."""
        try:  # (a closed pipe or a full disk may raise here: the lock still goes, the signals still come back)
            self.progress.bar.close()
            if self.finished:
                wall_time = datetime.timedelta(seconds=int(time.time() - self.start_time))
                self.progress.say(f"finished {self.args.total_timesteps} steps in {wall_time}: final eval "
                                  f"{self.progress.last_eval}; {self.dir}")
            self.metrics.writer.close()
            if self.args.track:
                importlib.import_module("wandb").finish()
        finally:
            os.remove(f"{self.dir}/lock")
            os.close(self.lock)
            for s, handler in self.handlers.items():
                signal.signal(s, handler)
        if self.signal and self.finished:  # after the run's last checkpoint and files: nothing left to save
            exit_outside_the_run(self.signal, None)


if __name__ == "__main__":
    for s in SIGNALS:
        signal.signal(s, exit_outside_the_run)
    args = tyro.cli(Args)
    if args.resume:  # the checkpoint's arguments are the defaults
        saved = read_checkpoint(args.resume)["args"]
        args = tyro.cli(Args, default=Args(**{k: saved[k] for k in Args.__dataclass_fields__ if k in saved}))
    try:
        main(args)
    except RuntimeError as e:  # an allocation the memory check let through (CUDA's OutOfMemoryError is one too)
        if "alloc" not in str(e):
            raise
        fail("out of memory (lower --buffer-size or --batch-size)", e)

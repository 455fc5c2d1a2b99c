"""TD7: TD3 + SALE embeddings + LAP replay + policy checkpoints (+ offline mode), in one file.

Paper: Fujimoto, Chang, Smith, Gu, Precup, Meger, "For SALE: State-Action Representation Learning for
Deep Reinforcement Learning", NeurIPS 2023, https://arxiv.org/abs/2306.02451. Defaults and the order of
every update are the authors' code (sfujim/TD7). Deliberate differences from it, none of which changes
the algorithm:
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its bootstrap and
  stores the true final observation (the authors' `done = 0 at the time limit`, made exact).
- The replay buffer, its LAP priorities and the max-priority and value-clip bookkeeping live on the training
  device, so an update never waits for it (the authors read two maxima back to the host every update).
  Sampling is theirs: exact priority-proportional, a cumulative sum and a binary search.
- Networks that are never trained directly (targets, fixed encoders, checkpoints) hold no gradients, and the
  actor update computes none for the critic or the fixed encoder (the authors compute and discard them).
  Adam is the fused implementation (the same update rule).
- With --no-checkpoints and --num-envs N, each vector step runs N training steps (one per env step).
- SIGINT/SIGTERM are acted on between training bursts, so after at most one episode's training steps.
- Added: periodic evaluation into evaluations.csv, checkpoints of the whole run with --resume, SIGINT/SIGTERM
  handling, a guard against non-finite losses, one-line errors for bad input, --save-buffer.

Offline mode (--offline --dataset PATH) trains on a fixed .npz dataset with the TD3+BC term and no policy
checkpoints, as the authors' D4RL mode; global_step then counts training steps. The file holds float arrays
observations (N, obs_dim), actions (N, act_dim) in the env's units, rewards (N,), next_observations
(N, obs_dim) and terminals (N,) (1 where the episode terminated; 0 otherwise, time-limit truncations too);
--save-buffer writes an online run's replay buffer in this format.
"""
import copy
import csv
import json
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

# The -v4 MuJoCo envs are kept on purpose: the published results this project compares with use them.
warnings.filterwarnings("ignore", message=".*is out of date. You should consider upgrading.*")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (python, numpy, torch and the envs)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 0
    """CPU threads for torch; 0 keeps torch's default (one per core)"""
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
    env_id: str = "Hopper-v4"
    """the id of the environment"""
    total_timesteps: int = 1000000
    """total environment steps of the run"""
    num_envs: int = 1
    """parallel training environments (more than one needs --no-checkpoints)"""
    learning_starts: int = 25000
    """environment steps of uniformly random actions; training starts at the first episode end after them"""
    buffer_size: int = 1000000
    """the replay memory size"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
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
    """log losses, and check them for NaN, every this many env steps"""

    # Algorithm specific arguments (the authors' defaults)
    offline: bool = False
    """train offline on --dataset, with the behaviour-cloning term and no policy checkpoints"""
    dataset: Optional[str] = None
    """an .npz dataset for --offline (format in the module docstring)"""
    save_buffer: bool = False
    """write the replay buffer to runs/{run_name}/buffer.npz at the end, in the --dataset format"""
    checkpoints: bool = True
    """TD7's policy checkpoints: train in bursts at episode ends, evaluate with the checkpoint policy"""
    target_update_rate: int = 250
    """training steps between the hard copies into the target and fixed networks"""
    exploration_noise: float = 0.1
    """the scale of the exploration noise (in the normalised action space [-1, 1])"""
    policy_noise: float = 0.2
    """the scale of the target policy smoothing noise"""
    noise_clip: float = 0.5
    """clip of the target policy smoothing noise"""
    policy_frequency: int = 2
    """the frequency of actor updates, in training steps"""
    alpha: float = 0.4
    """LAP: priorities are max(|td|, min_priority) ** alpha"""
    min_priority: float = 1.0
    """LAP: the floor of the priorities and the Huber threshold of the critic loss"""
    lmbda: float = 0.1
    """offline: weight of the behaviour-cloning term"""
    max_eps_when_checkpointing: int = 20
    """episodes that judge a policy after --steps-before-checkpointing (1 before)"""
    steps_before_checkpointing: int = 750000
    """training steps after which checkpoints are judged on more episodes"""
    reset_weight: float = 0.9
    """the checkpoint's best minimum return is multiplied by this at that switch"""
    zs_dim: int = 256
    """the size of the SALE embeddings zs and zsa"""
    hidden_dim: int = 256
    """the hidden width of the encoder, critic and actor"""
    encoder_lr: float = 3e-4
    """the learning rate of the encoder"""
    critic_lr: float = 3e-4
    """the learning rate of the critic"""
    actor_lr: float = 3e-4
    """the learning rate of the actor"""


# Flags that may differ when resuming: they change how a run is watched, not what it computes.
RESUMABLE_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video",
                   "save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda",
                   "save_buffer"}


def fail(message):
    """Stop with one line on stderr and exit status 1: the form of every user error."""
    sys.exit(f"error: {message}")


def check_args(args):
    for name in ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq",
                 "policy_frequency", "target_update_rate", "encoder_lr", "critic_lr", "actor_lr", "zs_dim",
                 "hidden_dim", "max_eps_when_checkpointing", "min_priority"]:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["learning_starts", "eval_freq", "checkpoint_freq", "torch_threads", "policy_noise", "noise_clip",
                 "exploration_noise", "alpha", "lmbda", "steps_before_checkpointing", "reset_weight"]:
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not 0 <= args.gamma <= 1:
        fail(f"--gamma must lie in [0, 1], got {args.gamma}")
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}")
    if args.offline and not args.dataset:
        fail("--offline needs --dataset PATH")
    if args.dataset and not args.offline:
        fail("--dataset is only read with --offline")
    if args.num_envs > 1 and args.checkpoints and not args.offline:
        fail("--num-envs above 1 needs --no-checkpoints: a checkpoint judges whole episodes of one policy")


def make_env(env_id):
    return lambda: gym.make(env_id)


def check_env(env_id):
    """Fail with one line unless env_id names an env this script can learn: vector observations, bounded actions."""
    try:
        env = gym.make(env_id)
    except Exception as e:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        fail(f"cannot make --env-id {env_id!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Box):
        fail(f"{env_id} has a {type(act_space).__name__} action space; TD3 needs a continuous (Box) one, "
             "see sac_discrete.py")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{env_id} has unbounded actions; TD3's tanh policy needs finite bounds")
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        fail(f"{env_id} has {obs_space} observations; this script needs a flat vector (Box of one dimension)")


def to_env(action, low, high):
    """The one place where a normalised action in [-1, 1] becomes the env's action in [low, high]."""
    return low + (action + 1.0) * 0.5 * (high - low)


def env_state(env):
    """What it takes to continue one env's episode bit for bit: its RNG, time-limit counter and physics."""
    u = env.unwrapped
    state = {"np_random": u.np_random.bit_generator.state, "elapsed_steps": env.get_wrapper_attr("_elapsed_steps")}
    if hasattr(u, "model") and hasattr(u, "data"):  # MuJoCo: the full integration state, warm-start included
        import mujoco
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        physics = np.empty(mujoco.mj_stateSize(u.model, spec))
        mujoco.mj_getState(u.model, u.data, physics, spec)
        state["mujoco"] = physics
    elif hasattr(u, "state"):  # classic control
        state["state"] = np.array(u.state)
    return state


def set_env_state(env, state):
    u = env.unwrapped
    u.np_random.bit_generator.state = state["np_random"]
    env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
    if "mujoco" in state:
        import mujoco
        mujoco.mj_setState(u.model, u.data, state["mujoco"], mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(u.model, u.data)
    elif "state" in state:
        u.state = state["state"]


def AvgL1Norm(x, eps=1e-8):
    """x / max(mean(|x|) over the last dimension, eps): keeps an embedding's scale fixed."""
    return x / x.abs().mean(-1, keepdim=True).clamp(min=eps)


def LAP_huber(td, min_priority=1.0):
    """The LAP critic loss: 0.5 td^2 below min_priority, min_priority * td above; summed over heads, batch mean."""
    return torch.where(td < min_priority, 0.5 * td.pow(2), min_priority * td).sum(1).mean()


class Encoder(nn.Module):
    """SALE: the state encoder f(s) -> zs (AvgL1Norm'd) and the state-action encoder g(zs, a) -> zsa; ELU."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.zs_net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                                    nn.Linear(hidden, zs_dim))
        self.zsa_net = nn.Sequential(nn.Linear(zs_dim + act_dim, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                                     nn.Linear(hidden, zs_dim))

    def zs(self, obs):
        return AvgL1Norm(self.zs_net(obs))

    def zsa(self, zs, action):
        return self.zsa_net(torch.cat([zs, action], 1))


class Actor(nn.Module):
    """pi(s, zs): a0 = AvgL1Norm(Linear(s)), then [a0, zs] through a 256-256 ReLU MLP with a tanh output in [-1, 1]."""

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.l0 = nn.Linear(obs_dim, hidden)
        self.net = nn.Sequential(nn.Linear(zs_dim + hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, obs, zs):
        return self.net(torch.cat([AvgL1Norm(self.l0(obs)), zs], 1))


class Critic(nn.Module):
    """Two heads Q_i(s, a, zsa, zs): q0 = AvgL1Norm(Linear([s, a])), then [q0, zsa, zs] through a 256-256 ELU MLP.

    forward returns Q values of shape (batch, 2).
    """

    def __init__(self, obs_dim, act_dim, zs_dim=256, hidden=256):
        super().__init__()
        self.q0 = nn.ModuleList(nn.Linear(obs_dim + act_dim, hidden) for _ in range(2))
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * zs_dim + hidden, hidden), nn.ELU(), nn.Linear(hidden, hidden), nn.ELU(),
                          nn.Linear(hidden, 1)) for _ in range(2))

    def forward(self, obs, action, zsa, zs):
        sa, embeddings = torch.cat([obs, action], 1), torch.cat([zsa, zs], 1)
        return torch.cat([head(torch.cat([AvgL1Norm(q0(sa)), embeddings], 1)) for q0, head in zip(self.q0, self.heads)], 1)


class LAPReplayBuffer:
    """LAP replay in one preallocated float32 tensor on the training device, with a priority per row.

    A row is [obs, action, reward, terminated, next_obs], actions normalised to [-1, 1]. New rows get the
    current max priority; a batch is drawn with probability proportional to priority (exactly: a cumulative
    sum and a binary search, as the authors' code); there are no importance weights.
    """

    def __init__(self, capacity, obs_dim, act_dim, device):
        self.capacity, self.device, self.pos, self.full = capacity, device, 0, False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)
        self.priority = torch.zeros(capacity, device=device)
        self.max_priority = torch.ones((), device=device)
        self.idx = None  # the rows of the last batch, whose priorities update_priority sets

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        rows = np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1, dtype=np.float32)
        idx = torch.from_numpy((self.pos + np.arange(len(rows))) % self.capacity).to(self.device)
        self.data[idx] = torch.from_numpy(rows).to(self.device)
        self.priority[idx] = self.max_priority
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity

    def sample(self, batch_size):
        """obs, action, reward, terminated, next_obs; reward and terminated of shape (batch, 1)."""
        csum = torch.cumsum(self.priority[: len(self)], 0)
        value = torch.rand(batch_size, device=self.device) * csum[-1]
        self.idx = torch.searchsorted(csum, value).clamp(max=len(self) - 1)
        return self.data[self.idx].split(self.split, dim=1)

    def update_priority(self, priority):
        self.priority[self.idx] = priority
        self.max_priority = torch.maximum(self.max_priority, priority.max())

    def reset_max_priority(self):
        self.max_priority = self.priority[: len(self)].max()

    def state_dict(self):
        return {"data": self.data[: len(self)].cpu(), "priority": self.priority[: len(self)].cpu(), "pos": self.pos,
                "full": self.full, "max_priority": self.max_priority.cpu()}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.priority[: len(state["priority"])] = state["priority"].to(self.device)
        self.pos, self.full, self.max_priority = state["pos"], state["full"], state["max_priority"].to(self.device)


class TD7(nn.Module):
    """All of TD7's networks, optimisers and value-clip bookkeeping, and one training step in the authors' order."""

    def __init__(self, obs_dim, act_dim, args, device):
        super().__init__()
        self.args, self.training_steps = args, 0
        self.encoder = Encoder(obs_dim, act_dim, args.zs_dim, args.hidden_dim)
        self.actor = Actor(obs_dim, act_dim, args.zs_dim, args.hidden_dim)
        self.critic = Critic(obs_dim, act_dim, args.zs_dim, args.hidden_dim)
        # Copies that are only ever overwritten, never trained: they hold no gradients.
        self.fixed_encoder, self.fixed_encoder_target, self.checkpoint_encoder = (
            copy.deepcopy(self.encoder).requires_grad_(False) for _ in range(3))
        self.actor_target, self.checkpoint_actor = (copy.deepcopy(self.actor).requires_grad_(False) for _ in range(2))
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        # Value clipping: targets are clipped to the range of all targets seen up to the last target update.
        self.register_buffer("value_range", torch.tensor([1e8, -1e8]))  # running (min, max) of the targets
        self.register_buffer("value_clip", torch.zeros(2))  # (min_target, max_target): 0/0 before the first copy
        self.register_buffer("actor_loss", torch.zeros(()))
        self.to(device)
        # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
        self.optimizers = {name: torch.optim.Adam(getattr(self, name).parameters(), lr=lr, fused=True)
                           for name, lr in (("encoder", args.encoder_lr), ("critic", args.critic_lr),
                                            ("actor", args.actor_lr))}

    def train_step(self, rb):
        """One TD7 training step; returns the (critic, actor, encoder) losses and the mean Q, on the device."""
        args = self.args
        self.training_steps += 1
        obs, action, reward, terminated, next_obs = rb.sample(args.batch_size)

        # Encoder: g(f(s), a) predicts f(s'), both from the current encoder.
        with torch.no_grad():
            next_zs = self.encoder.zs(next_obs)
        encoder_loss = F.mse_loss(self.encoder.zsa(self.encoder.zs(obs), action), next_zs)
        self.optimizers["encoder"].zero_grad(set_to_none=True)
        encoder_loss.backward()
        self.optimizers["encoder"].step()

        # Critic: clipped double-Q target through the fixed target encoder, LAP-Huber loss.
        with torch.no_grad():
            fixed_target_zs = self.fixed_encoder_target.zs(next_obs)
            noise = (torch.randn_like(action) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
            next_action = (self.actor_target(next_obs, fixed_target_zs) + noise).clamp(-1.0, 1.0)
            fixed_target_zsa = self.fixed_encoder_target.zsa(fixed_target_zs, next_action)
            next_q = self.critic_target(next_obs, next_action, fixed_target_zsa, fixed_target_zs).min(1, keepdim=True)[0]
            target = reward + (1.0 - terminated) * args.gamma * next_q.clamp(self.value_clip[0], self.value_clip[1])
            self.value_range = torch.stack((torch.minimum(self.value_range[0], target.min()),
                                            torch.maximum(self.value_range[1], target.max())))
            fixed_zs = self.fixed_encoder.zs(obs)
            fixed_zsa = self.fixed_encoder.zsa(fixed_zs, action)
        q = self.critic(obs, action, fixed_zsa, fixed_zs)
        td = (q - target).abs()
        critic_loss = LAP_huber(td, args.min_priority)
        self.optimizers["critic"].zero_grad(set_to_none=True)
        critic_loss.backward()
        self.optimizers["critic"].step()

        # LAP: the sampled rows' priorities become their largest TD error.
        rb.update_priority(td.detach().max(1)[0].clamp(min=args.min_priority).pow(args.alpha))

        # Actor, every policy_frequency steps: gradients reach the actor only.
        if self.training_steps % args.policy_frequency == 0:
            self.critic.requires_grad_(False)
            pi = self.actor(obs, fixed_zs)
            q_pi = self.critic(obs, pi, self.fixed_encoder.zsa(fixed_zs, pi), fixed_zs)
            actor_loss = -q_pi.mean()
            if args.offline:  # TD3+BC
                actor_loss = actor_loss + args.lmbda * q_pi.abs().mean().detach() * F.mse_loss(pi, action)
            self.optimizers["actor"].zero_grad(set_to_none=True)
            actor_loss.backward()
            self.optimizers["actor"].step()
            self.critic.requires_grad_(True)
            self.actor_loss = actor_loss.detach()

        # The cascade: each target takes the network it follows, the fixed target encoder the old fixed encoder.
        if self.training_steps % args.target_update_rate == 0:
            self.actor_target.load_state_dict(self.actor.state_dict())
            self.critic_target.load_state_dict(self.critic.state_dict())
            self.fixed_encoder_target.load_state_dict(self.fixed_encoder.state_dict())
            self.fixed_encoder.load_state_dict(self.encoder.state_dict())
            rb.reset_max_priority()
            self.value_clip = self.value_range.clone()
        return torch.stack((critic_loss.detach(), self.actor_loss, encoder_loss.detach(), q.detach().mean()))


@dataclass
class CheckpointPolicy:
    """TD7's policy checkpoints as a state machine over episode ends (the authors' maybe_train_and_checkpoint).

    A policy is judged on the minimum return of its episodes: 1 episode at first, max_eps_when_checkpointing
    after steps_before_checkpointing training steps. It becomes the checkpoint if it does at least as well as
    the checkpoint did; as soon as one episode does worse, judging stops early. Either way, the agent then
    trains for as many steps as the judged episodes took.
    """
    max_eps_before_update: int = 1
    eps_since_update: int = 0
    timesteps_since_update: int = 0
    min_return: float = 1e8
    best_min_return: float = -1e8

    def episode_end(self, length, episode_return):
        """Returns (take_checkpoint, training steps to run now)."""
        self.eps_since_update += 1
        self.timesteps_since_update += length
        self.min_return = min(self.min_return, episode_return)
        if self.min_return < self.best_min_return:  # worse than the checkpoint: stop judging early
            return False, self.reset()
        if self.eps_since_update == self.max_eps_before_update:
            self.best_min_return = self.min_return
            return True, self.reset()
        return False, 0

    def reset(self):
        steps, self.eps_since_update, self.timesteps_since_update, self.min_return = self.timesteps_since_update, 0, 0, 1e8
        return steps

    def before_training_step(self, training_steps, args):
        """At steps_before_checkpointing: judge on more episodes, and lower the bar by reset_weight."""
        if training_steps == args.steps_before_checkpointing:
            self.best_min_return *= args.reset_weight
            self.max_eps_before_update = args.max_eps_when_checkpointing


def drop_evaluations_after(path, global_step):
    """On resume, forget evaluations made after the checkpoint: the resumed run makes them again."""
    if os.path.exists(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(rows[:1] + [row for row in rows[1:] if int(row[0]) <= global_step])


def evaluate(policy, env_id, episodes, seed, device, video_folder=None, video_prefix="eval"):
    """Returns of `episodes` full episodes of the deterministic `policy` (no noise), on a separate env."""
    if video_folder:
        env = gym.wrappers.RecordVideo(gym.make(env_id, render_mode="rgb_array"), video_folder,
                                       episode_trigger=lambda e: e == 0, name_prefix=video_prefix)
    else:
        env = gym.make(env_id)
    low, high = env.action_space.low, env.action_space.high
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, episode_return = False, 0.0
        while not done:
            with torch.no_grad():
                action = policy(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])[0].cpu().numpy()
            obs, reward, terminated, truncated, _ = env.step(to_env(action, low, high))
            episode_return += float(reward)
            done = terminated or truncated
        returns.append(episode_return)
    env.close()
    return returns


DATASET_KEYS = ("observations", "actions", "rewards", "next_observations", "terminals")


def load_dataset(path, obs_dim, act_dim, low, high):
    """The --dataset arrays (format in the module docstring), actions normalised to [-1, 1]; fails with one line."""
    try:
        with np.load(path) as data:
            d = {key: np.asarray(data[key], dtype=np.float64) for key in DATASET_KEYS}
    except Exception as e:
        fail(f"cannot read --dataset {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    n = len(d["observations"])
    expected = {"observations": (n, obs_dim), "actions": (n, act_dim), "rewards": (n,),
                "next_observations": (n, obs_dim), "terminals": (n,)}
    for key, shape in expected.items():
        if d[key].shape != shape:
            fail(f"--dataset {path}: {key} has shape {d[key].shape}, the env needs {shape}")
    d["actions"] = np.clip(2.0 * (d["actions"] - low) / (high - low) - 1.0, -1.0, 1.0)
    return d


def main(args):
    check_args(args)
    checkpoint = None
    if args.resume:
        try:
            checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
            saved_args = checkpoint["args"]
        except Exception as e:
            fail(f"cannot read --resume file {args.resume}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        for name, value in asdict(args).items():
            if name not in RESUMABLE_FLAGS and saved_args.get(name) != value:
                fail(f"--resume file {args.resume} was made with --{name.replace('_', '-')} {saved_args.get(name)}, "
                     f"not {value}")
    check_env(args.env_id)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.capture_video and "DISPLAY" not in os.environ:
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high
    dataset = load_dataset(args.dataset, obs_dim, act_dim, low, high) if args.offline else None
    if args.cuda and not torch.cuda.is_available():
        print("warning: --cuda is set but no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")

    if checkpoint:
        run_name = checkpoint["run_name"]
        run_dir = os.path.dirname(os.path.abspath(args.resume))
    else:
        run_name = f"{args.env_id.replace('/', '-').replace(':', '-')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = os.path.abspath(os.path.join("runs", run_name))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=asdict(args),
                   name=run_name, id=run_name[-64:].replace(".", "-"), resume="allow", save_code=True, dir=run_dir)
    writer = SummaryWriter(run_dir, purge_step=checkpoint["global_step"] if checkpoint else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the random actions before learning starts

    agent = TD7(obs_dim, act_dim, args, device)
    rb = LAPReplayBuffer(len(dataset["observations"]) if args.offline else args.buffer_size, obs_dim, act_dim, device)
    if args.offline and not checkpoint:
        rb.add(dataset["observations"], dataset["actions"], dataset["rewards"], dataset["terminals"],
               dataset["next_observations"])
    policy = CheckpointPolicy()
    use_checkpoints = args.checkpoints and not args.offline

    obs, _ = envs.reset(seed=args.seed)
    global_step, allow_train, wall_time = 0, args.offline, 0.0
    episode_return, episode_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
    if checkpoint:
        agent.load_state_dict(checkpoint["agent"])
        for name, optimizer in agent.optimizers.items():
            optimizer.load_state_dict(checkpoint["optimizers"][name])
        agent.training_steps = checkpoint["training_steps"]
        rb.load_state_dict(checkpoint["rb"])
        policy = CheckpointPolicy(**checkpoint["policy"])
        if all("mujoco" in state or "state" in state for state in checkpoint["envs"]):
            for env, state in zip(envs.envs, checkpoint["envs"]):
                set_env_state(env, state)
            obs, episode_return, episode_length = checkpoint["obs"], checkpoint["episode_return"], checkpoint["episode_length"]
        else:
            print(f"warning: cannot restore the state of {args.env_id}; the resumed run starts new episodes",
                  file=sys.stderr)
        global_step, allow_train, wall_time = checkpoint["global_step"], checkpoint["allow_train"], checkpoint["wall_time"]
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        rng.bit_generator.state = checkpoint["rng"]["actions"]
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if device.type == "cuda" and checkpoint["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(checkpoint["rng"]["cuda"])
        drop_evaluations_after(os.path.join(run_dir, "evaluations.csv"), global_step)
        print(f"resumed {run_dir} at global_step {global_step}")

    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")

    def save_checkpoint():
        state = {"agent": agent.state_dict(), "optimizers": {k: o.state_dict() for k, o in agent.optimizers.items()},
                 "training_steps": agent.training_steps, "rb": rb.state_dict(), "policy": asdict(policy)}
        state.update(args=asdict(args), run_name=run_name, global_step=global_step, allow_train=allow_train,
                     wall_time=wall_time + time.time() - start_time, obs=obs, episode_return=episode_return,
                     episode_length=episode_length, envs=[env_state(env) for env in envs.envs],
                     rng={"python": random.getstate(), "numpy": np.random.get_state(), "actions": rng.bit_generator.state,
                          "torch": torch.get_rng_state(),
                          "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None})
        torch.save(state, checkpoint_path + ".tmp")
        os.replace(checkpoint_path + ".tmp", checkpoint_path)  # a kill while writing leaves the old checkpoint whole

    def eval_networks():
        """Evaluation and the saved model use the checkpoint policy when there is one."""
        if use_checkpoints:
            return agent.checkpoint_actor, agent.checkpoint_encoder
        return agent.actor, agent.fixed_encoder

    def run_evaluation():
        stop_if_nonfinite()
        actor, encoder = eval_networks()
        video_folder = os.path.join("videos", run_name) if args.capture_video else None
        returns = evaluate(lambda o: actor(o, encoder.zs(o)), args.env_id, args.eval_episodes, args.seed + 100_000,
                           device, video_folder, video_prefix=f"step-{global_step}")
        mean, std = float(np.mean(returns)), float(np.std(returns))
        writer.add_scalar("eval/episodic_return", mean, global_step)
        path = os.path.join(run_dir, "evaluations.csv")
        new_file = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            out = csv.writer(f)
            if new_file:
                out.writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns"])
            out.writerow([global_step, round(wall_time + time.time() - start_time, 1), mean, std,
                          " ".join(f"{r:.2f}" for r in returns)])
        return mean, std

    def crossed(freq, step_size=args.num_envs):
        return freq > 0 and global_step // freq != (global_step - step_size) // freq

    # Each training step's losses stay on the device until the next log, so that a non-finite one can be
    # reported with its step without waiting for the device after every training step.
    loss_history, n_history = torch.zeros(args.log_freq, 4, device=device), 0

    def stop_if_nonfinite(cause=None):
        """Fail naming the first non-finite loss since the last log."""
        bad = (~torch.isfinite(loss_history[:n_history, :3])).nonzero().tolist()
        if bad:
            i, which = bad[0]
            step = agent.training_steps - (n_history - 1 - i)
            cause = f"{('critic', 'actor', 'encoder')[which]} loss at training step {step}, global_step {global_step}"
        if cause:
            fail(f"non-finite {cause}; stopping. Last checkpoint: "
                 f"{checkpoint_path if os.path.exists(checkpoint_path) else 'none'}")

    def train(steps):
        nonlocal n_history, sps_start
        if sps_start is None:
            sps_start = (global_step, time.time())
        for _ in range(steps):
            if use_checkpoints:
                policy.before_training_step(agent.training_steps, args)
            loss_history[n_history] = agent.train_step(rb)
            n_history += 1
            if n_history == args.log_freq:
                stop_if_nonfinite()
                for name, value in zip(("critic_loss", "actor_loss", "encoder_loss", "q_values"), loss_history.mean(0)):
                    writer.add_scalar(f"losses/{name}", value.item(), global_step)
                writer.add_scalar("losses/value_clip_max", agent.value_clip[1].item(), global_step)
                writer.add_scalar("charts/training_steps", agent.training_steps, global_step)
                sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                n_history = 0

    stop_signal = []
    previous_handlers = {s: signal.signal(s, lambda signum, frame: stop_signal.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
    start_time, sps_start, last_eval = time.time(), None, None
    print(f"run {run_dir}: {args.env_id}, {args.total_timesteps} steps on {device}")
    try:
        while global_step < args.total_timesteps:
            if args.offline:
                global_step += 1
                train(1)
            else:
                if not allow_train:
                    action = rng.uniform(-1.0, 1.0, (args.num_envs, act_dim))
                else:
                    with torch.no_grad():
                        o = torch.as_tensor(obs, dtype=torch.float32, device=device)
                        action = agent.actor(o, agent.fixed_encoder.zs(o))
                        action = (action + torch.randn_like(action) * args.exploration_noise).clamp(-1.0, 1.0)
                        action = action.cpu().numpy()
                    if not np.isfinite(action).all():  # the action is on the host anyway: a free check every step
                        stop_if_nonfinite(f"action at global_step {global_step}")
                next_obs, reward, terminated, truncated, infos = envs.step(to_env(action, low, high))
                global_step += args.num_envs

                # Same-step autoreset: next_obs of a finished env is already the next episode's first
                # observation; the transition must store the true final one.
                real_next_obs = next_obs.copy()
                if "_final_obs" in infos:
                    for i in np.flatnonzero(infos["_final_obs"]):
                        real_next_obs[i] = infos["final_obs"][i]
                rb.add(obs, action, reward, terminated, real_next_obs)
                obs = next_obs
                if allow_train and not use_checkpoints:
                    train(args.num_envs)

                episode_return += reward
                episode_length += 1
                for i in np.flatnonzero(terminated | truncated):
                    writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                    writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                    if allow_train and use_checkpoints:
                        take_checkpoint, steps = policy.episode_end(int(episode_length[i]), float(episode_return[i]))
                        if take_checkpoint:
                            agent.checkpoint_actor.load_state_dict(agent.actor.state_dict())
                            agent.checkpoint_encoder.load_state_dict(agent.fixed_encoder.state_dict())
                        train(steps)
                    allow_train = allow_train or global_step > args.learning_starts
                    episode_return[i], episode_length[i] = 0.0, 0

            if crossed(args.eval_freq, 1 if args.offline else args.num_envs):
                last_eval = (global_step, *run_evaluation())
                sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9) if sps_start else 0.0
                eta = f"{(args.total_timesteps - global_step) / sps / 60:.1f} min" if sps else "-"
                print(f"step {global_step}/{args.total_timesteps} | eval return {last_eval[1]:.1f} +- {last_eval[2]:.1f}"
                      f" | SPS {sps:.0f} | ETA {eta}", flush=True)
            if crossed(args.checkpoint_freq, 1 if args.offline else args.num_envs):
                save_checkpoint()
            if stop_signal:
                save_checkpoint()
                name = signal.Signals(stop_signal[0]).name
                print(f"{name} at global_step {global_step}: checkpoint written to {checkpoint_path}; "
                      f"continue with --resume {checkpoint_path}", file=sys.stderr)
                sys.exit(128 + stop_signal[0])

        if last_eval is None or last_eval[0] != global_step:
            last_eval = (global_step, *run_evaluation())
        if args.checkpoint_freq:
            save_checkpoint()
        if args.save_model:
            actor, encoder = eval_networks()
            torch.save({"actor": actor.state_dict(), "encoder": encoder.state_dict(), "critic": agent.critic.state_dict(),
                        "args": asdict(args)}, os.path.join(run_dir, "model.pt"))
        if args.save_buffer:
            obs_, action_, reward_, terminated_, next_obs_ = (x.cpu().numpy() for x in rb.data[: len(rb)].split(rb.split, 1))
            np.savez(os.path.join(run_dir, "buffer.npz"), observations=obs_, actions=to_env(action_, low, high),
                     rewards=reward_[:, 0], next_observations=next_obs_, terminals=terminated_[:, 0])
        print(f"done: {global_step} steps, final eval return {last_eval[1]:.1f} +- {last_eval[2]:.1f}")
    finally:
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)
        envs.close()
        writer.close()
        if args.track:
            wandb.finish()
    return {"run_dir": run_dir, "global_step": global_step, "eval_mean": last_eval[1], "eval_std": last_eval[2]}


if __name__ == "__main__":
    main(tyro.cli(Args))

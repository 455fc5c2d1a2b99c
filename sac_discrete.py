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
- The actor and alpha losses sum over the actions and average over states (CleanRL averages over both,
  which scales the actor's gradient by 1/|A|).
- Atari: gymnasium's AtariPreprocessing (30 no-op starts, frame skip 4 with max-pooling, 84x84 greyscale) and
  4 stacked frames; rewards are clipped to their sign for training only (logged and evaluated returns are the
  game's score); in training no end-of-life termination and no FIRE on reset (Machado et al. 2018 advise
  against both); in evaluation FIRE is pressed at the start of each life (FireOnLifeStart), so that an argmax
  policy that never fires does not wait out ALE's 108,000-frame cap in a game that needs FIRE to serve. The
  Nature-CNN is initialised as sac_atari's (Kaiming-normal, zero biases). The replay buffer stores each frame
  once, as uint8 (FrameReplayBuffer): 1e6 transitions take about 7 GB (CleanRL's: 56), on the GPU when it has
  room, else in pinned host memory.
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its
  bootstrap and stores the true final observation; only `terminated` stops the bootstrap.
- The replay buffer is preallocated on the training device; nothing in the update
  waits for the device, except every --log-freq updates to log; an env step waits only for its action.
- Evaluation is deterministic: the mode of the policy, argmax of the logits.
- --compile and --cudagraphs (both off by default; off computes exactly what it always did) run each update
  as a compiled callable or a replayed CUDA graph: README, "The GPU fast path".
- Added: periodic deterministic evaluation, checkpoints with --resume, SIGINT/SIGTERM handling,
  a guard against non-finite losses, and one-line errors for bad input.

The file has two parts: the algorithm, from here to `main`, and below the banner after it the run
machinery, which changes nothing that is computed.
"""
import contextlib
import csv
import datetime
import io
import itertools
import json
import os
import random
import signal
import sys
import time
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
    torch_deterministic: bool = True
    """on a GPU, deterministic algorithms wherever PyTorch has them (README, "Reproducibility on a GPU")"""
    cuda: bool = True
    """use the GPU if there is one"""
    torch_threads: int = 1
    """CPU threads for torch: 1 does not slow down when other work shares the cores (README, Threads); 0 keeps
    torch's default, one per core"""
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
    cudagraphs: bool = False
    """capture each update step once as a CUDA graph and replay it (needs a GPU; can be combined with --compile)"""

    # Algorithm specific arguments
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 3e-4
    """the learning rate of the Q network optimizer (and of alpha's, as CleanRL)"""
    adam_eps: Optional[float] = None
    """the epsilon of the Adam optimizers (default: 1e-8 for vector observations, 1e-4 for images)"""
    update_frequency: Optional[int] = None
    """one critic, actor and alpha update every this many env steps (default: 1 for vectors, 4 for images)"""
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


def make_env(env_id, render_mode=None):
    def thunk():
        if not is_atari(env_id):
            return gym.make(env_id, render_mode=render_mode)
        env = gym.make(env_id, frameskip=1, render_mode=render_mode)  # AtariPreprocessing skips the frames
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84)
        return gym.wrappers.FrameStackObservation(env, 4)

    return thunk


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
    """Uniform replay in one preallocated float32 tensor on the training device.

    A row is [obs, action, reward, terminated, next_obs], written by slice from one asynchronous upload per vector
    step. A batch is gathered into `self.batch`, which stays in one place in memory (as a CUDA graph needs); the
    length is a device tensor too, so that sampling never reads a host number. Actions are stored as floats (exact
    for any action count below 2**24).
    """

    def __init__(self, capacity, obs_dim, act_dim, batch_size, device):
        self.capacity = capacity
        self.device = device
        self.pos = 0
        self.full = False
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
        self.pos = state["pos"]
        self.full = state["full"]
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
        self.new_episode = np.ones(num_envs, dtype=bool)

    def add(self, obs, action, reward, terminated, next_obs, done):
        """Store one vector step's transitions."""
        f, envs = self.fields, np.arange(len(obs))
        pos = np.where(self.new_episode, (self.pos + 1) % self.rows, self.pos)  # a reset observation: a new row
        starts = self.new_episode
        f["frame"][envs[starts], pos[starts]] = torch.as_tensor(np.asarray(obs)[starts, -1]).to(f["frame"].device)
        f["steps"][envs[starts], pos[starts]] = 0
        for name, value in [("action", action), ("reward", reward), ("terminated", terminated)]:
            f[name][envs, pos] = torch.as_tensor(np.asarray(value), dtype=f[name].dtype).to(f[name].device)
        f["valid"][envs, pos] = True
        # The next observation's newest frame goes to the next row, which no longer starts a transition; the rows
        # whose frames reach back to it (the oldest of the ring) cannot be sampled any more.
        nxt = (pos + 1) % self.rows
        f["frame"][envs, nxt] = torch.as_tensor(np.asarray(next_obs)[:, -1]).to(f["frame"].device)
        f["steps"][envs, nxt] = (f["steps"][envs, pos] + 1).clamp(max=self.stack - 1)
        for j in range(self.stack):
            f["valid"][envs, (nxt + j) % self.rows] = False
        self.pos = nxt
        self.new_episode = np.asarray(done, dtype=bool).copy()

    def frames(self, env, row):
        """The stacked observation whose newest frame is at `row`: (batch, stack, H, W)."""
        back = torch.arange(self.stack - 1, -1, -1, device=row.device)
        rows = (row[:, None] - torch.minimum(back, self.fields["steps"][env, row][:, None])) % self.rows
        return self.fields["frame"][env[:, None], rows]

    def sample(self):
        """obs, action, reward, terminated, next_obs, as ReplayBuffer.sample."""
        valid = self.fields["valid"].flatten()
        flat = torch.multinomial(valid.float(), self.batch_size, replacement=True)
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
    """One step on the critics' summed MSE; returns the mean of their losses and their mean Q values."""
    obs, action, reward, terminated, next_obs = batch
    with torch.no_grad():
        next_q = qf_target(next_obs).min(0).values
        target = td_target(reward, terminated, next_q, actor(next_obs), alpha, args.gamma)
    taken = action.long().view(1, -1, 1).expand(len(qf.qs), -1, 1)
    q = qf(obs).gather(2, taken)  # Q_i(s, a_taken), (num_q, batch, 1)
    qf_loss = ((q - target) ** 2).mean((1, 2)).sum()
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    q_optimizer.step()
    return qf_loss.detach() / len(q), q.detach().mean((1, 2))


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
    qf_loss, qf_values = update_critic(batch, actor, qf, qf_target, q_optimizer, alpha, args)
    actor_loss, entropy = update_actor(batch[0], actor, qf, actor_optimizer, alpha)
    alpha_loss = (update_alpha(entropy, log_alpha, alpha_optimizer, target_entropy) if args.autotune
                  else torch.zeros((), device=alpha.device))
    return qf_loss, qf_values, actor_loss, alpha_loss, entropy.mean()


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


def main(args):
    observations = check_env(args.env_id)  # "vector" or "image"
    args = replace(args, **{name: value for name, value in OBSERVATION_DEFAULTS[observations].items()
                            if getattr(args, name) is None})
    check_args(args)
    if args.cudagraphs and observations == "image":  # the frames may live in host memory, which a graph cannot read
        fail("--cudagraphs is for vector observations; image observations run eagerly or with --compile")
    checkpoint = read_checkpoint(args)
    device = choose_device(args)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)  # the random actions before learning starts

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_shape, n_actions = envs.single_observation_space.shape, int(envs.single_action_space.n)

    actor = Actor(obs_shape, n_actions).to(device)
    qf = Critic(obs_shape, n_actions, num_q=args.num_critics).to(device)
    qf_target = Critic(obs_shape, n_actions, num_q=args.num_critics).to(device)
    qf_target.load_state_dict(qf.state_dict())
    log_alpha = torch.tensor(float(np.log(1.0 if args.autotune else args.alpha)), device=device, requires_grad=True)
    target_entropy = args.target_entropy_ratio * float(np.log(n_actions))
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr, eps=args.adam_eps, fused=True,
                                       capturable=args.cudagraphs)
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=args.q_lr, eps=args.adam_eps, fused=True,
                                   capturable=args.cudagraphs)
    alpha_optimizer = torch.optim.Adam([log_alpha], lr=args.q_lr, eps=args.adam_eps, fused=True,
                                       capturable=args.cudagraphs)
    if observations == "image":  # frames stored once; on the host, pinned, when the GPU has no room for them
        storage = replay_storage(FrameReplayBuffer(args.buffer_size, obs_shape, args.num_envs, args.batch_size,
                                                   device, torch.device("meta")), device)
        rb = FrameReplayBuffer(args.buffer_size, obs_shape, args.num_envs, args.batch_size, device, storage)
    else:  # replay_storage fails with one line when the buffer does not fit
        replay_storage(ReplayBuffer(args.buffer_size, obs_shape[0], 1, args.batch_size, torch.device("meta")), device)
        rb = ReplayBuffer(args.buffer_size, obs_shape[0], 1, args.batch_size, device)
    # The updates as callables without arguments, compiled or captured as CUDA graphs under the flags.
    update_step = accelerate(partial(update, rb, actor, qf, qf_target, q_optimizer, actor_optimizer, log_alpha,
                                     alpha_optimizer, target_entropy, args), args)
    target_step = accelerate(partial(soft_update, qf_target, qf, args.tau), args)
    # Everything a checkpoint holds besides the loop's counters and the envs: --resume restores exactly these.
    state = {"actor": actor, "qf": qf, "qf_target": qf_target, "log_alpha": log_alpha,
             "actor_optimizer": actor_optimizer, "q_optimizer": q_optimizer, "alpha_optimizer": alpha_optimizer,
             "rb": rb, "rng": rng}
    run = Run(args, checkpoint, device)

    obs, _ = envs.reset(seed=args.seed)
    obs_on_device = upload(obs, device)
    episode_return, episode_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
    global_step, num_updates = 0, 0
    if checkpoint:
        (global_step, num_updates), episodes = run.restore(checkpoint, state, envs.envs)
        obs, episode_return, episode_length = episodes or (obs, episode_return, episode_length)
        obs_on_device = upload(obs, device)
    try:
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
                    run.flush(global_step, cause=f"policy at global_step {global_step}")
            next_obs, reward, terminated, truncated, infos = envs.step(action)
            global_step += args.num_envs
            run.check_finite(global_step, observation=next_obs)

            episode_return += reward
            episode_length += 1
            for i in np.flatnonzero(terminated | truncated):
                run.log_episode(global_step, episode_return[i], episode_length[i])
                episode_return[i], episode_length[i] = 0.0, 0

            # Atari trains on rewards clipped to their sign (as CleanRL); returns are logged unclipped.
            rb.add(obs, action, np.sign(reward) if observations == "image" else reward, terminated,
                   true_next_obs(next_obs, infos), terminated | truncated)
            obs = next_obs
            obs_on_device = upload(obs, device)

            if global_step > args.learning_starts and crossed(global_step, args.update_frequency, args.num_envs):
                qf_loss, qf_values, actor_loss, alpha_loss, entropy = update_step()
                num_updates += 1
                run.record(global_step, num_updates, qf_loss=qf_loss, actor_loss=actor_loss, alpha_loss=alpha_loss,
                           alpha=log_alpha.exp().detach(), entropy=entropy, qf1_values=qf_values[0],
                           qf2_values=qf_values[1])
            if global_step > args.learning_starts and crossed(global_step, args.target_network_frequency,
                                                              args.num_envs):
                target_step()  # with --tau 1, a hard copy

            run.progress(global_step, num_updates)
            done = global_step >= args.total_timesteps
            if crossed(global_step, args.eval_freq, args.num_envs) or done:
                run.evaluate(global_step, actor.mode)
            if crossed(global_step, args.checkpoint_freq, args.num_envs) or (done and args.checkpoint_freq) or run.stop:
                run.save_checkpoint(state, (global_step, num_updates), envs.envs, (obs, episode_return, episode_length))
        if args.save_model:
            run.save_model(actor=actor, qf=qf)
    finally:
        envs.close()
        run.close()
    return run.result


# ======================================================================================================================
# Part 2: the run machinery. Nothing below changes what is computed: it checks the input, owns the run's directory
# (args.json, TensorBoard, evaluations.csv, checkpoints, the model), evaluates, stops on non-finite numbers and
# turns SIGINT/SIGTERM into a checkpoint.
# ======================================================================================================================

# Flags that may differ when resuming: they change how a run is watched, not what it computes.
RESUMABLE_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video",
                   "save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}


def fail(message):
    """Stop with one line on stderr and exit status 1: the form of every user error."""
    sys.exit(f"error: {message}")


def first_line(error):
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def parse_args(argv=None):
    """tyro's parser, with its error box shortened to one line in tyro's words: the message (which names the flag)
    and, for a misspelled flag, the one it resembles."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        return tyro.cli(Args, args=argv)
    message, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"  # tyro wraps its box at the terminal's width: one message, one row
    try:
        with contextlib.redirect_stderr(message):
            return tyro.cli(Args, args=argv)
    except SystemExit:
        rows = [row.strip("│ ").strip() for row in message.getvalue().splitlines() if row.startswith("│")]
        rows = [row for row in rows if row and not row.startswith(("─", "For full helptext"))]
        meant = rows[rows.index("Perhaps you meant:") + 1:] if "Perhaps you meant:" in rows else []
        hint = next((row for row in meant if row.startswith("--")), None)
        print(f"error: {rows[0] if rows else 'cannot parse the command line'}"
              + (f" (perhaps you meant {hint})" if hint else ""), file=sys.stderr)
        sys.exit(2)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def check_args(args):
    """Every numeric flag finite and in its range, before anything is written."""
    positive = ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq", "adam_eps",
                "update_frequency", "target_network_frequency", "policy_lr", "q_lr", "tau", "alpha",
                "target_entropy_ratio"]
    non_negative = ["learning_starts", "eval_freq", "checkpoint_freq", "torch_threads"]
    unit_interval = ["gamma", "tau"]
    for name, value in asdict(args).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not np.isfinite(value):
            fail(f"{flag} must be a finite number, got {value}")
        if name in positive and value <= 0 or name in non_negative and value < 0:
            fail(f"{flag} must be {'positive' if name in positive else 'non-negative'}, got {value}")
        if name in unit_interval and not 0 <= value <= 1:
            fail(f"{flag} must lie in [0, 1], got {value}")
    if args.target_entropy_ratio >= 1:
        fail(f"--target-entropy-ratio must lie in (0, 1), got {args.target_entropy_ratio}")
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}")
    if args.cudagraphs and not (args.cuda and torch.cuda.is_available()):
        fail("--cudagraphs needs a GPU: " + ("--no-cuda is set" if not args.cuda else "none is available"))
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} is not below --total-timesteps {args.total_timesteps}: no "
             "update would ever happen")
    if args.num_critics < 2:
        fail(f"--num-critics must be at least 2, got {args.num_critics}")


def check_env(env_id):
    """Fail with one line unless env_id names an env this script can learn: discrete actions, vector or image
    (Atari) observations. Returns the kind of observation, "vector" or "image"."""
    try:
        env = make_env(env_id)()
    except Exception as e:  # gymnasium raises many kinds: unknown id, missing extra, bad module path
        atari_id = "ALE/" in env_id or "NoFrameskip" in env_id
        hint = "; Atari needs the optional ale-py (pip install ale-py)" if ale_py is None and atari_id else ""
        fail(f"cannot make --env-id {env_id!r}: {first_line(e)}{hint}")
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(act_space, gym.spaces.Discrete):
        fail(f"{env_id} has a {type(act_space).__name__} action space; SAC here needs a Discrete one, "
             "see sac_continuous.py")
    if isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1:
        return "vector"
    if is_atari(env_id):
        return "image"
    fail(f"{env_id} has {obs_space} observations; this script needs a flat vector or an Atari game")

def read_checkpoint(args):
    """The --resume checkpoint (None without one), refused unless it was made with the same algorithm flags."""
    if not args.resume:
        return None
    try:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
    except Exception as e:
        fail(f"cannot read --resume file {args.resume}: {first_line(e)}")
    if not isinstance(checkpoint, dict) or not {"args", "run_name", "global_step", "state"} <= checkpoint.keys():
        fail(f"--resume file {args.resume} is not a checkpoint.pt of this script (model.pt holds only the networks)")
    saved_args, step = checkpoint["args"], checkpoint["global_step"]
    for name, value in asdict(args).items():
        if name not in RESUMABLE_FLAGS and saved_args.get(name) != value:
            fail(f"--resume file {args.resume} was made with --{name.replace('_', '-')} {saved_args.get(name)}, "
                 f"not {value}")
    if args.total_timesteps <= step:
        fail(f"--total-timesteps {args.total_timesteps} is not beyond the checkpoint's global_step {step}")
    return checkpoint


def choose_device(args):
    """The training device (a warning line when --cuda finds no GPU); sets torch's CPU threads."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.cuda and not torch.cuda.is_available():
        print("warning: --cuda is set but no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and args.torch_deterministic:  # the CPU's ops are deterministic already
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition, before its first use
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that has no such version
    return device


def accelerate(step, args):
    """An update step (a callable without arguments) as it runs: as it is, torch.compile'd (--compile), and/or
    captured as one CUDA graph (--cudagraphs)."""
    step = torch.compile(step) if args.compile else step
    return CudaGraph(step) if args.cudagraphs else step


class CudaGraph:
    """--cudagraphs: `step` runs eagerly for `warmup` calls on a side stream (optimizer state, compilation), is then
    captured once and replayed: one launch per update instead of one per kernel. It may only read and write tensors
    that stay in place (in-place state, the buffer's `batch` and `length`), and it returns the same output tensors,
    overwritten, at every replay."""

    def __init__(self, step, warmup=3):
        self.step, self.warmup, self.graph, self.outputs = step, warmup, None, None

    def __call__(self):
        if self.warmup:
            self.warmup -= 1
            stream = torch.cuda.Stream()
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


def crossed(step, freq, step_size):
    """True when the last step_size steps, ending at step, crossed a multiple of freq (never when freq is 0)."""
    return freq > 0 and step // freq != (step - step_size) // freq


def env_state(env):
    """What it takes to continue one env's episode bit for bit: its RNG, time-limit counter and state. Only
    classic-control envs are restored; an Atari run resumes with new episodes."""
    u = env.unwrapped
    if not hasattr(u, "state"):
        return {}
    return {"np_random": u.np_random.bit_generator.state, "elapsed_steps": env.get_wrapper_attr("_elapsed_steps"),
            "state": np.array(u.state)}


def set_env_state(env, state):
    u = env.unwrapped
    u.np_random.bit_generator.state = state["np_random"]
    env.set_wrapper_attr("_elapsed_steps", state["elapsed_steps"])
    u.state = state["state"]


def evaluate(policy, env_id, episodes, seed, device, video_folder=None, video_prefix="eval"):
    """Returns of `episodes` full episodes of the deterministic `policy` (no noise), on a separate env."""
    if video_folder:
        env = gym.wrappers.RecordVideo(make_env(env_id, render_mode="rgb_array")(), video_folder,
                                       episode_trigger=lambda e: e == 0, name_prefix=video_prefix)
    else:
        env = make_env(env_id)()
    if is_atari(env_id) and "FIRE" in env.unwrapped.get_action_meanings():
        env = FireOnLifeStart(env)
    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, episode_return = False, 0.0
        while not done:
            with torch.no_grad():
                action = policy(upload(obs[None], device))[0].item()  # the one wait per step
            obs, reward, terminated, truncated, _ = env.step(action)
            episode_return += float(reward)
            done = terminated or truncated
        returns.append(episode_return)
    env.close()
    return returns


class FireOnLifeStart(gym.Wrapper):
    """Evaluation only: press FIRE at the start of every life, as CleanRL's FireResetEnv does at each reset, so that
    an argmax policy that never fires cannot stall a game that needs FIRE to serve (Breakout) until ALE's frame cap;
    the reward of those steps counts."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        obs, _, terminated, truncated, info = self.env.step(self.env.unwrapped.get_action_meanings().index("FIRE"))
        return self.reset(**kwargs) if terminated or truncated else (obs, info)

    def step(self, action):
        lives = self.env.unwrapped.ale.lives()
        obs, reward, terminated, truncated, info = self.env.step(action)
        if not (terminated or truncated) and self.env.unwrapped.ale.lives() < lives:
            obs, fire_reward, terminated, truncated, info = self.env.step(
                self.env.unwrapped.get_action_meanings().index("FIRE"))
            reward += fire_reward
        return obs, reward, terminated, truncated, info


def drop_evaluations_after(path, global_step):
    """On resume, forget evaluations made after the checkpoint (the resumed run makes them again), rewriting the file
    through a temp file; a malformed file is refused and left as it is. Returns the last evaluation kept, as the
    progress line shows it."""
    if not os.path.exists(path):
        return "-"
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    try:
        kept = rows[:1] + [row for row in rows[1:] if int(row[0]) <= global_step]
        last = f"{float(kept[-1][2]):.1f} +- {float(kept[-1][3]):.1f}" if len(kept) > 1 else "-"
    except (ValueError, IndexError):
        fail(f"cannot resume: {path} has a malformed row; mend or remove it")
    write_atomically(path, lambda f: csv.writer(f).writerows(kept))
    return last


def write_atomically(path, write):
    """Write a text file through a temp file and a rename: a kill while writing leaves the old file whole."""
    with open(path + ".tmp", "w", newline="") as f:
        write(f)
    os.replace(path + ".tmp", path)


def claim_run_dir(name):
    """Create runs/{name} exclusively, or runs/{name}-1, -2 ... when another run took it in the same second: a run
    owns its directory. Returns the name taken and the directory."""
    try:
        os.makedirs("runs", exist_ok=True)
    except OSError as e:
        fail(f"cannot create the run directory in {os.path.abspath('runs')}: {e.strerror}")
    for i in itertools.count():
        candidate = name if i == 0 else f"{name}-{i}"
        try:
            os.mkdir(os.path.join("runs", candidate))
            return candidate, os.path.abspath(os.path.join("runs", candidate))
        except FileExistsError:
            continue


def replay_storage(buffer, device):
    """Where the replay `buffer` (built on the meta device: shapes and dtypes, no memory) can live: the training
    device when it fits in its free memory (the GPU's, or the host's: MemAvailable within a cgroup's limit), else,
    for frames on a GPU run, pinned host memory; otherwise fail with one line."""
    tensors = [t for v in vars(buffer).values() for t in (v.values() if isinstance(v, dict) else [v])]
    need = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    free = {"cpu": os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")}  # free pages, without reclaimable cache
    with contextlib.suppress(OSError, IndexError):
        free["cpu"] = int(open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        free["cpu"] = min(free["cpu"], int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    if device.type == "cuda":
        free["cuda"] = torch.cuda.mem_get_info(device)[0]
    if need <= free[device.type]:
        return device
    if device.type == "cuda" and isinstance(buffer, FrameReplayBuffer) and need <= free["cpu"]:
        return torch.device("cpu")
    fail(f"the replay buffer needs {need / 2**30:.1f} GiB, more than the {free[device.type] / 2**30:.1f} GiB free on "
         f"the {device.type}{' and the host' if device.type == 'cuda' else ''}; lower --buffer-size")


class Run:
    """One run's directory and logs, its evaluations and checkpoints, SIGINT/SIGTERM and the non-finite guard."""

    def __init__(self, args, checkpoint, device):
        self.args, self.device, self.start_time, self.wall_time = args, device, time.time(), 0.0
        self.eval_text = "-"  # the last evaluation, as the progress line shows it
        if checkpoint:
            self.name, self.dir = checkpoint["run_name"], os.path.dirname(os.path.abspath(args.resume))
            self.eval_text = drop_evaluations_after(os.path.join(self.dir, "evaluations.csv"),
                                                    checkpoint["global_step"])
        else:
            env_name = args.env_id.replace("/", "-").replace(":", "-")
            self.name, self.dir = claim_run_dir(f"{env_name}__{args.exp_name}__{args.seed}__{int(time.time())}")
        self.checkpoint_path = os.path.join(self.dir, "checkpoint.pt")
        write_atomically(os.path.join(self.dir, "args.json"), lambda f: json.dump(asdict(args), f, indent=2))
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=asdict(args), name=self.name, id=self.name[-64:].replace(".", "-"), resume="allow",
                       save_code=True, dir=self.dir)
        if args.capture_video and "DISPLAY" not in os.environ:
            os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering
        self.writer = SummaryWriter(self.dir, purge_step=checkpoint["global_step"] if checkpoint else None)
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))
        # Each update's metrics stay on the device until the next log, so that a non-finite one can be named with
        # its update and step without waiting for the device after every update.
        self.names, self.history, self.updates, self.sps_start = None, [], [], None
        self.tty, self.reported, self.pending = sys.stdout.isatty(), False, False
        self.last_report = (time.time(), *(checkpoint["counters"][:2] if checkpoint else (0, 0)))  # time, step, updates
        self.stop = []  # the signal that asks the run to stop, once one arrives
        self.handlers = {s: signal.signal(s, lambda signum, frame: self.stop.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
        print(f"run {self.dir}: {args.env_id}, {args.total_timesteps} steps on {device}", flush=True)

    def sps(self, global_step):
        """Env steps per second since the first update."""
        start_step, start_time = self.sps_start or (global_step, time.time())
        return (global_step - start_step) / max(time.time() - start_time, 1e-9)

    def progress(self, global_step, num_updates):
        """Env steps/s and updates/s since the last report, the last evaluation and the ETA: on a terminal a line
        rewritten every second, in a log (Slurm, a sweep) a line after 10 s and then every minute."""
        now, (then, last_step, last_updates) = time.time(), self.last_report
        if now - then < (1.0 if self.tty else 60.0 if self.reported else 10.0):
            return
        sps, ups = (global_step - last_step) / (now - then), (num_updates - last_updates) / (now - then)
        left = max(self.args.total_timesteps - global_step, 0)
        eta = datetime.timedelta(seconds=int(left / sps)) if sps else "-"
        line = (f"step {global_step}/{self.args.total_timesteps} ({1 - left / self.args.total_timesteps:.0%}) | "
                f"{sps:.0f} steps/s | {ups:.0f} updates/s | last eval {self.eval_text} | ETA {eta}")
        if self.tty:  # rewritten in place until a line of its own (self.say) follows
            print("\r\033[K" + line, end="", flush=True)
        else:
            self.say(line)
        self.last_report, self.reported, self.pending = (now, global_step, num_updates), True, self.tty

    def say(self, line):
        """Print a line of its own; on a terminal, in place of the progress line."""
        print(("\r\033[K" if self.pending else "") + line, flush=True)
        self.pending = False

    def log_episode(self, global_step, episode_return, episode_length):
        self.writer.add_scalar("charts/episodic_return", episode_return, global_step)
        self.writer.add_scalar("charts/episodic_length", episode_length, global_step)

    def record(self, global_step, update, **metrics):
        """Keep one update's metrics (scalar tensors, on the device); check and log them every --log-freq updates."""
        self.sps_start = self.sps_start or (global_step, time.time())
        self.names = list(metrics)
        self.history.append(torch.stack(list(metrics.values())))
        self.updates.append((update, global_step))
        if len(self.history) == self.args.log_freq:
            self.flush(global_step)

    def flush(self, global_step, cause=None):
        """Stop on the first non-finite metric since the last log, or else on `cause`; log the metrics' means."""
        values = torch.stack(self.history) if self.history else None
        bad = [] if values is None else (~torch.isfinite(values)).nonzero().tolist()
        if bad:
            (update, step), name = self.updates[bad[0][0]], self.names[bad[0][1]]
            cause = f"{name} in update {update}, at global_step {step}"
        if cause:
            fail(f"non-finite {cause}; stopping. Last checkpoint: "
                 f"{self.checkpoint_path if os.path.exists(self.checkpoint_path) else 'none'}")
        if values is not None:
            for name, value in zip(self.names, values.mean(0).tolist()):
                self.writer.add_scalar(f"losses/{name}", value, global_step)
            self.writer.add_scalar("charts/SPS", int(self.sps(global_step)), global_step)
        self.history, self.updates = [], []

    def check_finite(self, global_step, **arrays):
        """Stop if a host array (an action, an observation) is not finite, naming it, or any non-finite metric."""
        for name, array in arrays.items():
            if not np.isfinite(array).all():
                self.flush(global_step, cause=f"{name} at global_step {global_step}")

    def evaluate(self, global_step, policy):
        """Evaluate `policy` into evaluations.csv and TensorBoard, and print a progress line."""
        self.flush(global_step)
        video_folder = os.path.join("videos", self.name) if self.args.capture_video else None
        returns = evaluate(policy, self.args.env_id, self.args.eval_episodes, self.args.seed + 100_000, self.device,
                           video_folder, video_prefix=f"step-{global_step}")
        mean, std = float(np.mean(returns)), float(np.std(returns))
        self.writer.add_scalar("eval/episodic_return", mean, global_step)
        path = os.path.join(self.dir, "evaluations.csv")
        new_file = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            if new_file:
                csv.writer(f).writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns"])
            csv.writer(f).writerow([global_step, round(self.elapsed(), 1), mean, std,
                                    " ".join(f"{r:.2f}" for r in returns)])
        self.result = {"run_dir": self.dir, "global_step": global_step, "eval_mean": mean, "eval_std": std}
        self.eval_text = f"{mean:.1f} +- {std:.1f}"
        self.say(f"step {global_step}/{self.args.total_timesteps} | eval return {self.eval_text}")

    def elapsed(self):
        return self.wall_time + time.time() - self.start_time

    def save_checkpoint(self, state, counters, envs, episodes):
        """Write everything needed to continue: `state`, the loop's counters (global_step first), the envs and their
        episodes, every RNG. After a SIGINT/SIGTERM, exit once it is written."""
        self.flush(counters[0])
        checkpoint = {"args": asdict(self.args), "run_name": self.name, "global_step": counters[0],
                      "wall_time": self.elapsed(), "counters": counters,
                      "state": {name: value.bit_generator.state if isinstance(value, np.random.Generator)
                                else value.detach().cpu() if isinstance(value, torch.Tensor)
                                else value.state_dict() for name, value in state.items()},
                      "envs": [env_state(env) for env in envs], "episodes": episodes,
                      "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state(),
                              "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
        torch.save(checkpoint, self.checkpoint_path + ".tmp")
        os.replace(self.checkpoint_path + ".tmp", self.checkpoint_path)  # a kill while writing leaves the old one whole
        if self.stop:
            print(f"{signal.Signals(self.stop[0]).name} at global_step {counters[0]}: checkpoint written to "
                  f"{self.checkpoint_path}; continue with --resume {self.checkpoint_path}", file=sys.stderr)
            sys.exit(128 + self.stop[0])

    def restore(self, checkpoint, state, envs):
        """Load a checkpoint into `state`, the envs and the RNGs; returns the loop's counters and the envs' episodes
        (None when the envs' state cannot be restored: the run then starts new episodes)."""
        for name, value in state.items():
            if isinstance(value, np.random.Generator):
                value.bit_generator.state = checkpoint["state"][name]
            elif isinstance(value, torch.Tensor):
                value.data.copy_(checkpoint["state"][name])
            else:
                value.load_state_dict(checkpoint["state"][name])
        episodes = checkpoint["episodes"]
        if all("state" in saved for saved in checkpoint["envs"]):
            for env, saved in zip(envs, checkpoint["envs"]):
                set_env_state(env, saved)
        else:
            print(f"warning: cannot restore the state of {self.args.env_id}; the resumed run starts new episodes",
                  file=sys.stderr)
            episodes = None
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if torch.cuda.is_available() and checkpoint["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
        self.wall_time = checkpoint["wall_time"]
        print(f"resumed {self.dir} at global_step {checkpoint['global_step']}", flush=True)
        return checkpoint["counters"], episodes

    def save_model(self, **networks):
        """Write the final networks, on the CPU, to model.pt."""
        torch.save({**{name: {k: v.cpu() for k, v in net.state_dict().items()} for name, net in networks.items()},
                    "args": asdict(self.args)}, os.path.join(self.dir, "model.pt"))

    def close(self):
        if self.pending:  # end the progress line before any last message
            print()
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.writer.close()
        if self.args.track:
            import wandb

            wandb.finish()


if __name__ == "__main__":
    main(parse_args())

"""SAC: Soft Actor-Critic with automatic entropy tuning, in one file.

Papers: Haarnoja, Zhou, Abbeel, Levine, "Soft Actor-Critic: Off-Policy Maximum Entropy Deep Reinforcement
Learning with a Stochastic Actor", ICML 2018, https://arxiv.org/abs/1801.01290, and Haarnoja et al., "Soft
Actor-Critic Algorithms and Applications", 2018, https://arxiv.org/abs/1812.05905 (automatic entropy tuning).
Defaults are CleanRL's sac_continuous_action.py. Deliberate differences from CleanRL, none of which changes the
algorithm:
- gymnasium 1.x vector envs in same-step autoreset mode: a time-limit truncation keeps its
  bootstrap and stores the true final observation; only `terminated` stops the bootstrap.
- The policy and the replay buffer work in normalised actions in [-1, 1]; the env's bounds are applied in
  one place, `to_env`. The log-probability, and so the entropy target -dim(A), is that of the normalised
  action; CleanRL's includes log(action_scale), which is 0 for every MuJoCo task with bounds [-1, 1]
  (Humanoid's [-0.4, 0.4] is the exception: there its target is in effect 0.9 nats per dimension lower).
- Alpha loss: mean(-alpha * stopgrad(log pi + target_entropy)) with alpha = exp(log_alpha), the form of
  CleanRL and of the seed implementation (the paper's gradient, taken with respect to log_alpha). Autotuning
  starts from alpha = 1 (log_alpha = 0), as both do; --no-autotune holds alpha at --alpha.
- The alpha update reuses the log pi of the actor step just made (CleanRL draws a fresh sample from the
  updated actor; the two differ by one actor step).
- --num-critics Q-networks (default 2) as one module evaluated as one batched matmul; the target and the
  actor use their minimum. The actor update differentiates through the critics with their weights held
  fixed, so it computes no critic gradients (CleanRL computes them and throws them away).
- One gradient update per vector step (with --num-envs N that is one update per N env steps).
- The replay buffer is one preallocated tensor on the training device; nothing in the update
  waits for the device, except every --log-freq steps to log.
- Evaluation is deterministic: the mode of the policy, tanh(mean).
- Added: periodic deterministic evaluation, checkpoints with --resume, SIGINT/SIGTERM handling,
  a guard against non-finite losses, and one-line errors for bad input.
"""
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
    """parallel training environments (one gradient update per vector step)"""
    learning_starts: int = 5000
    """environment steps of uniformly random actions before learning starts"""
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

    # Algorithm specific arguments
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer (and of alpha's, as CleanRL)"""
    tau: float = 0.005
    """target network smoothing coefficient"""
    policy_frequency: int = 2
    """every this many critic updates, as many actor and alpha updates (delayed, the counts stay equal)"""
    target_network_frequency: int = 1
    """the frequency of the Polyak target update, in critic updates"""
    num_critics: int = 2
    """the number of Q networks; the target and the actor use their minimum"""
    alpha: float = 0.2
    """the entropy coefficient when --no-autotune"""
    autotune: bool = True
    """tune alpha automatically towards the target entropy -dim(A) (starting from alpha = 1)"""


# Flags that may differ when resuming: they change how a run is watched, not what it computes.
RESUMABLE_FLAGS = {"total_timesteps", "resume", "track", "wandb_project_name", "wandb_entity", "capture_video",
                   "save_model", "eval_freq", "eval_episodes", "checkpoint_freq", "log_freq", "torch_threads", "cuda"}


def fail(message):
    """Stop with one line on stderr and exit status 1: the form of every user error."""
    sys.exit(f"error: {message}")


def check_args(args):
    for name in ["total_timesteps", "num_envs", "buffer_size", "batch_size", "eval_episodes", "log_freq",
                 "policy_frequency", "target_network_frequency", "policy_lr", "q_lr", "tau", "alpha"]:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["learning_starts", "eval_freq", "checkpoint_freq", "torch_threads"]:
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not 0 <= args.gamma <= 1 or args.tau > 1:
        fail(f"--gamma and --tau must lie in [0, 1], got {args.gamma} and {args.tau}")
    if args.num_critics < 2:
        fail(f"--num-critics must be at least 2, got {args.num_critics}")
    if args.batch_size > args.buffer_size:
        fail(f"--batch-size {args.batch_size} is larger than --buffer-size {args.buffer_size}")


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
        fail(f"{env_id} has a {type(act_space).__name__} action space; SAC here needs a continuous (Box) one, "
             "see sac_discrete.py")
    if not (np.isfinite(act_space.low).all() and np.isfinite(act_space.high).all()):
        fail(f"{env_id} has unbounded actions; SAC's tanh policy needs finite bounds")
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


LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """Tanh-Gaussian policy: 256-256 ReLU MLP giving the mean and log-std of a Gaussian whose sample is
    squashed by tanh into the normalised action space [-1, 1]."""

    def __init__(self, obs_dim, act_dim, hidden=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)

    def forward(self, obs):
        h = self.net(obs)
        log_std = torch.tanh(self.log_std(h))  # squashed into [LOG_STD_MIN, LOG_STD_MAX], as CleanRL
        return self.mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def sample(self, obs):
        """A reparameterised action a = tanh(u), u ~ N(mean, std), and its log-probability, of shape (batch, 1)."""
        mean, log_std = self(obs)
        return tanh_gaussian_sample(mean, log_std)

    def mode(self, obs):
        """The deterministic action used in evaluation: tanh(mean)."""
        return torch.tanh(self(obs)[0])


def tanh_gaussian_sample(mean, log_std):
    """log pi(a) = log N(u; mean, std) - sum_i log(1 - tanh(u_i)^2): the change of variables through tanh.

    log(1 - tanh(u)^2) is computed as 2 * (log 2 - u - softplus(-2u)), exact and stable where tanh(u) = +-1 in
    float32 (CleanRL's log(1 - a^2 + 1e-6) biases it there).
    """
    u = mean + log_std.exp() * torch.randn_like(mean)
    log_prob = -0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * np.log(2 * np.pi)
    log_prob = log_prob - 2 * (np.log(2.0) - u - nn.functional.softplus(-2 * u))
    return torch.tanh(u), log_prob.sum(-1, keepdim=True)


class Critic(nn.Module):
    """`num_q` Q-networks (256-256 ReLU MLPs on [obs, action]) with stacked weights, run as one batched matmul.

    Each head is initialised like nn.Linear. forward returns Q values of shape (num_q, batch, 1).
    """

    def __init__(self, obs_dim, act_dim, hidden=256, num_q=2):
        super().__init__()
        sizes = [obs_dim + act_dim, hidden, hidden, 1]
        bound = [1 / np.sqrt(n_in) for n_in in sizes[:-1]]
        self.weights = nn.ParameterList(
            [nn.Parameter(torch.empty(num_q, n_in, n_out).uniform_(-b, b)) for n_in, n_out, b in zip(sizes, sizes[1:], bound)])
        self.biases = nn.ParameterList(
            [nn.Parameter(torch.empty(num_q, 1, n_out).uniform_(-b, b)) for n_out, b in zip(sizes[1:], bound)])

    def forward(self, obs, action, weights=None, biases=None):
        weights, biases = weights or list(self.weights), biases or list(self.biases)
        x = torch.cat([obs, action], -1).expand(len(weights[0]), -1, -1)
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = torch.baddbmm(b, x, w)
            if i < len(weights) - 1:
                x = torch.relu(x)
        return x

    def fixed(self, obs, action):
        """All Q values with the critic's weights held fixed: gradients reach the action, not the critic."""
        return self(obs, action, [w.detach() for w in self.weights], [b.detach() for b in self.biases])


class ReplayBuffer:
    """Uniform replay in one preallocated float32 tensor on the training device.

    A row is [obs, action, reward, terminated, next_obs]: one host-to-device copy per vector step, one
    gather per batch. Actions are stored normalised, in [-1, 1].
    """

    def __init__(self, capacity, obs_dim, act_dim, device):
        self.capacity, self.device, self.pos, self.full = capacity, device, 0, False
        self.split = [obs_dim, act_dim, 1, 1, obs_dim]
        self.data = torch.zeros(capacity, sum(self.split), device=device)

    def __len__(self):
        return self.capacity if self.full else self.pos

    def add(self, obs, action, reward, terminated, next_obs):
        rows = np.concatenate([obs, action, reward[:, None], terminated[:, None], next_obs], 1, dtype=np.float32)
        idx = (self.pos + np.arange(len(rows))) % self.capacity
        self.data[torch.from_numpy(idx).to(self.device)] = torch.from_numpy(rows).to(self.device)
        self.full = self.full or self.pos + len(rows) >= self.capacity
        self.pos = (self.pos + len(rows)) % self.capacity

    def sample(self, batch_size):
        """obs, action, reward, terminated, next_obs; reward and terminated of shape (batch, 1)."""
        idx = torch.randint(0, len(self), (batch_size,), device=self.device)
        return self.data[idx].split(self.split, dim=1)

    def state_dict(self):
        return {"data": self.data[: len(self)].cpu(), "pos": self.pos, "full": self.full}

    def load_state_dict(self, state):
        self.data[: len(state["data"])] = state["data"].to(self.device)
        self.pos, self.full = state["pos"], state["full"]


class EntropyCoefficient(nn.Module):
    """alpha = exp(log_alpha): learnt when autotuning, else a constant."""

    def __init__(self, alpha):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.tensor(float(np.log(alpha))))

    def forward(self):
        return self.log_alpha.exp()


def sac_target(reward, terminated, next_q, next_log_prob, alpha, gamma):
    """y = r + gamma * (1 - terminated) * (min_i Q'_i(s', a') - alpha * log pi(a'|s')), a' ~ pi(s')."""
    return reward + gamma * (1.0 - terminated) * (next_q - alpha * next_log_prob)


def soft_update(target, source, tau):
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def update_critic(batch, actor, qf, qf_target, q_optimizer, alpha, args):
    obs, action, reward, terminated, next_obs = batch
    with torch.no_grad():
        next_action, next_log_prob = actor.sample(next_obs)
        next_q = qf_target(next_obs, next_action).min(0).values
        target = sac_target(reward, terminated, next_q, next_log_prob, alpha, args.gamma)
    q = qf(obs, action)
    qf_loss = ((q - target) ** 2).mean((1, 2)).sum()  # the sum of the critics' MSE losses
    q_optimizer.zero_grad(set_to_none=True)
    qf_loss.backward()
    q_optimizer.step()
    return qf_loss.detach(), q.detach().mean((1, 2))


def update_actor(obs, actor, qf, actor_optimizer, alpha):
    """Actor loss mean(alpha * log pi(a|s) - min_i Q_i(s, a)), a ~ pi(s) reparameterised; returns the loss and
    log pi(a|s), which the alpha update reuses."""
    action, log_prob = actor.sample(obs)
    actor_loss = (alpha * log_prob - qf.fixed(obs, action).min(0).values).mean()
    actor_optimizer.zero_grad(set_to_none=True)
    actor_loss.backward()
    actor_optimizer.step()
    return actor_loss.detach(), log_prob.detach()


def update_alpha(log_prob, log_alpha_module, alpha_optimizer, target_entropy):
    """alpha loss mean(-alpha * (log pi + target_entropy)): alpha grows while the entropy -log pi is below the
    target, and shrinks while it is above."""
    alpha_loss = (-log_alpha_module() * (log_prob + target_entropy)).mean()
    alpha_optimizer.zero_grad(set_to_none=True)
    alpha_loss.backward()
    alpha_optimizer.step()
    return alpha_loss.detach()


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
    if args.cuda and not torch.cuda.is_available():
        print("warning: --cuda is set but no GPU is available; running on the CPU", file=sys.stderr)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.capture_video and "DISPLAY" not in os.environ:
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering

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

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim, act_dim = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high

    actor = Actor(obs_dim, act_dim).to(device)
    qf = Critic(obs_dim, act_dim, num_q=args.num_critics).to(device)
    qf_target = Critic(obs_dim, act_dim, num_q=args.num_critics).to(device)
    qf_target.load_state_dict(qf.state_dict())
    log_alpha = EntropyCoefficient(1.0 if args.autotune else args.alpha).to(device)
    target_entropy = -float(act_dim)
    # fused: one kernel for all parameters, 2-3x faster than the default foreach Adam on CPU; same update rule
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True)
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=args.q_lr, fused=True)
    alpha_optimizer = torch.optim.Adam(log_alpha.parameters(), lr=args.q_lr, fused=True)
    rb = ReplayBuffer(args.buffer_size, obs_dim, act_dim, device)
    modules = {"actor": actor, "qf": qf, "qf_target": qf_target, "log_alpha": log_alpha,
               "actor_optimizer": actor_optimizer, "q_optimizer": q_optimizer, "alpha_optimizer": alpha_optimizer,
               "rb": rb}

    obs, _ = envs.reset(seed=args.seed)
    global_step, num_updates, wall_time = 0, 0, 0.0
    episode_return, episode_length = np.zeros(args.num_envs), np.zeros(args.num_envs, dtype=np.int64)
    if checkpoint:
        for name, module in modules.items():
            module.load_state_dict(checkpoint[name])
        if all("mujoco" in state or "state" in state for state in checkpoint["envs"]):
            for env, state in zip(envs.envs, checkpoint["envs"]):
                set_env_state(env, state)
            obs, episode_return, episode_length = checkpoint["obs"], checkpoint["episode_return"], checkpoint["episode_length"]
        else:
            print(f"warning: cannot restore the state of {args.env_id}; the resumed run starts new episodes",
                  file=sys.stderr)
        global_step, num_updates, wall_time = checkpoint["global_step"], checkpoint["num_updates"], checkpoint["wall_time"]
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
        state = {name: module.state_dict() for name, module in modules.items()}
        state.update(args=asdict(args), run_name=run_name, global_step=global_step, num_updates=num_updates,
                     wall_time=wall_time + time.time() - start_time, obs=obs, episode_return=episode_return,
                     episode_length=episode_length, envs=[env_state(env) for env in envs.envs],
                     rng={"python": random.getstate(), "numpy": np.random.get_state(), "actions": rng.bit_generator.state,
                          "torch": torch.get_rng_state(),
                          "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None})
        torch.save(state, checkpoint_path + ".tmp")
        os.replace(checkpoint_path + ".tmp", checkpoint_path)  # a kill while writing leaves the old checkpoint whole

    def run_evaluation():
        stop_if_nonfinite()
        video_folder = os.path.join("videos", run_name) if args.capture_video else None
        returns = evaluate(actor.mode, args.env_id, args.eval_episodes, args.seed + 100_000, device, video_folder,
                           video_prefix=f"step-{global_step}")
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

    def crossed(freq):
        return freq > 0 and global_step // freq != (global_step - args.num_envs) // freq

    # Each update's losses stay on the device until the next log, so that a non-finite one can be reported
    # with its step without waiting for the device after every update.
    loss_history, n_history = torch.zeros(args.log_freq, 3, device=device), 0

    def stop_if_nonfinite(cause=None):
        """Fail naming the first non-finite loss since the last log (the latest update was at global_step)."""
        bad = (~torch.isfinite(loss_history[:n_history])).nonzero().tolist()
        if bad:
            i, which = bad[0]
            step = global_step - (n_history - 1 - i) * args.num_envs
            cause = f"{('critic', 'actor', 'alpha')[which]} loss at global_step {step}"
        if cause:
            fail(f"non-finite {cause}; stopping. Last checkpoint: "
                 f"{checkpoint_path if os.path.exists(checkpoint_path) else 'none'}")

    stop_signal = []
    previous_handlers = {s: signal.signal(s, lambda signum, frame: stop_signal.append(signum))
                         for s in (signal.SIGINT, signal.SIGTERM)}
    actor_loss = alpha_loss = torch.zeros((), device=device)
    start_time, sps_start, last_eval = time.time(), None, None
    print(f"run {run_dir}: {args.env_id}, {args.total_timesteps} steps on {device}")
    try:
        while global_step < args.total_timesteps:
            if global_step < args.learning_starts:
                action = rng.uniform(-1.0, 1.0, (args.num_envs, act_dim))
            else:
                with torch.no_grad():
                    action = actor.sample(torch.as_tensor(obs, dtype=torch.float32, device=device))[0].cpu().numpy()
                if not np.isfinite(action).all():  # the action is on the host anyway: a free check every step
                    stop_if_nonfinite(f"action at global_step {global_step}")
            next_obs, reward, terminated, truncated, infos = envs.step(to_env(action, low, high))
            global_step += args.num_envs

            episode_return += reward
            episode_length += 1
            for i in np.flatnonzero(terminated | truncated):
                writer.add_scalar("charts/episodic_return", episode_return[i], global_step)
                writer.add_scalar("charts/episodic_length", episode_length[i], global_step)
                episode_return[i], episode_length[i] = 0.0, 0

            # Same-step autoreset: next_obs of a finished env is already the next episode's first
            # observation; the transition must store the true final one.
            real_next_obs = next_obs.copy()
            if "_final_obs" in infos:
                for i in np.flatnonzero(infos["_final_obs"]):
                    real_next_obs[i] = infos["final_obs"][i]
            rb.add(obs, action, reward, terminated, real_next_obs)
            obs = next_obs

            if global_step > args.learning_starts:
                if sps_start is None:
                    sps_start = (global_step, time.time())
                batch = rb.sample(args.batch_size)
                alpha = log_alpha().detach()
                qf_loss, q_values = update_critic(batch, actor, qf, qf_target, q_optimizer, alpha, args)
                if num_updates % args.policy_frequency == 0:
                    for _ in range(args.policy_frequency):  # delayed, but as many actor updates as critic updates
                        actor_loss, log_prob = update_actor(batch[0], actor, qf, actor_optimizer, alpha)
                        if args.autotune:
                            alpha_loss = update_alpha(log_prob, log_alpha, alpha_optimizer, target_entropy)
                            alpha = log_alpha().detach()
                if num_updates % args.target_network_frequency == 0:
                    soft_update(qf_target, qf, args.tau)
                num_updates += 1
                loss_history[n_history] = torch.stack((qf_loss, actor_loss, alpha_loss))
                n_history += 1

                if crossed(args.log_freq):
                    stop_if_nonfinite()
                    n_history = 0
                    sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9)
                    writer.add_scalar("losses/qf1_values", q_values[0].item(), global_step)
                    writer.add_scalar("losses/qf2_values", q_values[1].item(), global_step)
                    writer.add_scalar("losses/qf_loss", qf_loss.item() / args.num_critics, global_step)
                    writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
                    writer.add_scalar("losses/alpha", log_alpha().item(), global_step)
                    if args.autotune:
                        writer.add_scalar("losses/alpha_loss", alpha_loss.item(), global_step)
                    writer.add_scalar("charts/SPS", int(sps), global_step)

            if crossed(args.eval_freq):
                last_eval = (global_step, *run_evaluation())
                sps = (global_step - sps_start[0]) / max(time.time() - sps_start[1], 1e-9) if sps_start else 0.0
                eta = f"{(args.total_timesteps - global_step) / sps / 60:.1f} min" if sps else "-"
                print(f"step {global_step}/{args.total_timesteps} | eval return {last_eval[1]:.1f} +- {last_eval[2]:.1f}"
                      f" | SPS {sps:.0f} | ETA {eta}", flush=True)
            if crossed(args.checkpoint_freq):
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
            torch.save({"actor": actor.state_dict(), "qf": qf.state_dict(), "args": asdict(args)},
                       os.path.join(run_dir, "model.pt"))
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

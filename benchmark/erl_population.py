"""ERL's population evaluation: env steps per second with the batched forward pass of erl_td3.py against the same
episodes run one individual at a time, written as a markdown table.

Workload: --pop-size untrained actors (the script's Actor), one episode each, on --env-id, CPU, one torch thread;
the same seeds for both ways, so the returns agree but for rounding (the largest difference is reported).
Median of --repeats.

    python benchmark/erl_population.py --env-id Hopper-v4 --pop-size 10
"""

import argparse
import datetime
import importlib.util
import platform
import statistics
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def load_erl():
    spec = importlib.util.spec_from_file_location("erl_td3", REPO / "erl_td3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="Hopper-v4")
    parser.add_argument("--pop-size", type=int, default=10)
    parser.add_argument("--episodes", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmark" / "results" / "erl_population.md"))
    args = parser.parse_args()
    erl = load_erl()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    env = gym.make(args.env_id)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    weights, biases = erl.stack_actors([erl.Actor(obs_dim, act_dim) for _ in range(args.pop_size)])
    device = torch.device("cpu")

    def seeded_envs(n, first_seed):
        envs = [gym.make(args.env_id) for _ in range(n)]
        for i, e in enumerate(envs):
            e.reset(seed=first_seed + i)
        return envs

    rates, differences = {"batched": [], "one at a time": []}, []
    for repeat in range(args.repeats):
        envs = seeded_envs(args.pop_size, repeat * 1000)  # made before the clock starts: only the episodes count
        start = time.perf_counter()
        batched, steps = erl.run_episodes(weights, biases, envs, args.episodes, 0.0, device)
        rates["batched"].append(steps / (time.perf_counter() - start))
        envs = [seeded_envs(1, repeat * 1000 + i) for i in range(args.pop_size)]
        start, alone, steps = time.perf_counter(), [], 0
        for i in range(args.pop_size):
            r, n = erl.run_episodes(
                [w[i : i + 1] for w in weights], [b[i : i + 1] for b in biases], envs[i], args.episodes, 0.0, device
            )
            alone.append(r[0])
            steps += n
        rates["one at a time"].append(steps / (time.perf_counter() - start))
        differences.append(float(np.max(np.abs(batched - np.array(alone)) / np.maximum(np.abs(alone), 1.0))))
    header = (
        f"\n## {datetime.date.today()}: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"1 thread, {args.env_id}, population {args.pop_size}, {args.episodes} episode(s) each, "
        f"median of {args.repeats}; largest relative difference between the two ways' returns: "
        f"{max(differences):.1e} (a batched matmul may round differently from a single one, and MuJoCo "
        f"amplifies it over long episodes)\n\n| evaluation | env steps/s (median) | range |\n|---|---|---|\n"
    )
    rows = [f"| {name} | {statistics.median(r):.0f} | {min(r):.0f}-{max(r):.0f} |" for name, r in rates.items()]
    print(header + "\n".join(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

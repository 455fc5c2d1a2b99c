#!/usr/bin/env bash
# Discrete SAC over seeds on a set of envs: SET=classic (CartPole, Acrobot, MountainCar; the default) or SET=atari
# (Pong, Breakout, BeamRider; needs the optional ale-py: pip install ".[atari]"). Settings from the environment,
# extra flags as arguments; SLURM="--slurm --time 24:00:00 --gpus 1" sends the runs to a Slurm job array:
#   SET=atari WORKERS=2 SEEDS="1 2 3" bash benchmark/sac_discrete.sh --total-timesteps 100000
cd "$(dirname "$0")/.." || exit 1
exec python benchmark/sweep.py sac_discrete.py --envs ${ENVS:-${SET:-classic}} --seeds ${SEEDS:-1 2 3} \
  --workers "${WORKERS:-1}" ${SLURM:-} -- "$@"

#!/usr/bin/env bash
# TD7 on the five MuJoCo benchmarks over seeds. Settings from the environment, extra flags as arguments; with
# SLURM="--slurm --time 24:00:00" the runs go to a Slurm job array (see benchmark/sweep.py --help):
#   WORKERS=4 SEEDS="1 2 3 4 5" ENVS="Hopper-v4" bash benchmark/td7.sh --total-timesteps 300000
cd "$(dirname "$0")/.." || exit 1
exec python benchmark/sweep.py td7_continuous.py --envs ${ENVS:-mujoco} --seeds ${SEEDS:-1 2 3} --workers "${WORKERS:-1}" \
  ${SLURM:-} -- "$@"

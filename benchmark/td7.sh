#!/usr/bin/env bash
# TD7 on the five MuJoCo benchmarks over seeds. Settings from the environment, extra flags as arguments:
#   WORKERS=4 SEEDS="1 2 3 4 5" ENVS="Hopper-v4" bash benchmark/td7.sh --total-timesteps 300000
cd "$(dirname "$0")/.." || exit 1
exec python benchmark/sweep.py td7_continuous.py \
  --envs ${ENVS:-Hopper-v4 HalfCheetah-v4 Walker2d-v4 Ant-v4 Humanoid-v4} \
  --seeds ${SEEDS:-1 2 3} --workers "${WORKERS:-1}" -- "$@"

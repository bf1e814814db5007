#!/usr/bin/env bash
# One GRPO-vs-proxy run with the judge as the frontier's gold (rl_judge_gold.yaml), from the
# repository root, after the rm-overopt replication (runs/rmo) and the judge's training (runs/jg):
#     experiments/2026-12-06-judge-gold-frontier/run_rl.sh SEED
# PYTHON names the interpreter (default: python).
set -euo pipefail
E=experiments/2026-12-06-judge-gold-frontier
SFT=$(ls -d runs/rmo/runs/sft-*/model)
PROXY=$(ls -d runs/rmo/runs/proxy-2048-*/model)
JUDGE=$(ls -d runs/jg/runs/judge-*/model)
"${PYTHON:-python}" -m rlhflab train "$E/rl_judge_gold.yaml" "model.name_or_path=$SFT" \
  "reward.components=[{name: reward_model, weight: 1.0, args: {path: $PROXY, kind: orm, normalize: none}}, {name: correctness, weight: 0.0}]" \
  "eval.frontier_gold.args.path=$JUDGE" "seed=$1" "run.name=judge-gold-seed$1"

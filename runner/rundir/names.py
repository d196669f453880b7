"""The names of a run folder's files (checkpoints/ holds checkpoint folders: runner.ckpt.files)."""

from __future__ import annotations

CONFIG = ".hydra/config.yaml"
OVERRIDES = ".hydra/overrides.yaml"
RUN_INFO = "run.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
MODEL = "model.safetensors"
MODEL_PART = "model.{}.safetensors"  # one part of a task made of several models (an SAE of a family)
CHECKPOINTS = "checkpoints"
LOG = "runner.log"  # what rank 0 printed (runner.log.tee); Hydra names it after hydra.job.name
RANK_LOG = "logs/rank-{}.log"  # each rank's warnings and errors (runner.log.ranks), the only file other ranks write
LOCK = ".lock"  # the folder's lock while a run (or a sweep, or a cache's writer) holds it: runner.rundir.locks
CLASH = "clash"  # runner.config.resolvers writes a refused launch's Hydra files to .hydra/clash-*

# What a run leaves in its folder; resume=scratch moves these aside before training again from step 0
OUTPUTS = (CHECKPOINTS, f"{METRICS}*", SUMMARY, RUN_INFO, "run-resumed-at-*.json", "model*.safetensors*")
SET_ASIDE = "before-scratch-{}"

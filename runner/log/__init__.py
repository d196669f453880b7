"""Loggers (runner.run.Logger): console, metrics.jsonl (jsonl), wandb (wandb_logger); run facts (info)."""

"""Several processes: environment detection (env), Single and DDP (strategies), FSDP (fsdp)."""

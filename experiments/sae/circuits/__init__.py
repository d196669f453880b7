"""Attribution graphs on the replacement model (Ameisen et al. 2025, "Circuit Tracing"; circuit-tracer's definitions):
frozen.py freezes a prompt's attention patterns and normalisation denominators, coders.py reads a CLT or one
transcoder per layer as the replacement's MLPs, attribute.py takes the direct effects (one backward pass per target,
in batches), prune.py the influence, pruning and scores, cli.py `python -m runner.attribute`."""

"""runner's tools: `python -m runner.<tool>` for each (evaluate, export, features, generate, report), `runner init`."""

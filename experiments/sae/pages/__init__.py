"""Feature statistics and the static feature pages (python -m runner.features)."""

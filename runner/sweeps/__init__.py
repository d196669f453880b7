"""Sweeps: a job's identity and objective (job), results.csv and the leaderboard (results), the Hydra callback."""

"""Evaluations of any SAE, runner's or imported: core metrics, sparse probing, feature absorption."""

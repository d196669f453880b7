"""runner's Hydra launchers: `hydra/launcher=torchrun` (torchrun_launcher.py), and the tasks of a submitit job as the
ranks of one run (slurm_launcher.py: runner/conf/hydra/launcher/slurm.yaml, slurm_local.yaml)."""

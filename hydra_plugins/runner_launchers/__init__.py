"""runner's Hydra launchers: `hydra/launcher=torchrun` (torchrun_launcher.py), and the tasks of a submitit job as the
ranks of one run (slurm_launcher.py: runner/conf/hydra/launcher/slurm.yaml, slurm_local.yaml); and the task packages'
config folders on Hydra's search path beside runner/conf (search_path.py)."""

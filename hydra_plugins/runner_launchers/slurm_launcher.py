"""`hydra/launcher=slurm` and `slurm_local` (runner/conf/hydra/launcher/): submitit's launchers, with the tasks of a
job as the ranks of one run (one task per GPU).

Submitit runs Hydra's task function, main(), in every task of a job, not runner's cli(). So each task here does first
what cli() does under torchrun: it learns its rank (submitit's job environment, exported as torch's RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT...), writes into the job folder the submitting process dated, and leaves .hydra/ and the
log file to rank 0.

hydra-submitit-launcher is optional (`pip install runner[slurm]`): without it, this module defines no launcher.
"""

from pathlib import Path
from typing import Any

from hydra._internal.grammar.utils import escape_special_characters
from hydra.core.utils import JobReturn

try:  # the module, not its classes: Hydra's plugin scan would list them a second time under this module's name
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:
    submitit_launcher = None


def export_rank() -> int:
    """This task's place in its submitit job (SLURM or local) as torch.distributed's variables; its rank.

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (the job's first host) and MASTER_PORT (unless set:
    derived from the job id, so two jobs on one node do not meet on one port), which runner.distributed.env reads.
    CUDA_VISIBLE_DEVICES stays: runner takes cuda:LOCAL_RANK itself.
    """
    import submitit

    return submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True).rank


class _TasksAreRanks:
    """Mixin over submitit's launchers: launch() runs in the submitting process, __call__() in every task."""

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        """Resolve the sweep folder here, once: the tasks start later, on other machines, with other clocks."""
        self.sweep_dir = str(Path(str(self.config.hydra.sweep.dir)).absolute())
        return super().launch(job_overrides, initial_job_idx)

    def __call__(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> JobReturn:
        """One task of a job: export its rank for torch.distributed, then run the job as rank 0 or a quiet rank."""
        from runner.config import resolvers
        from runner.distributed.env import QUIET_RANK

        resolvers.register()  # the config's resolvers (runner_now, runner_hydra_subdir) in this process
        overrides = [*sweep_overrides, f"hydra.sweep.dir={escape_special_characters(self.sweep_dir)}"]
        if export_rank() > 0:
            overrides += QUIET_RANK  # as cli() does under torchrun
        return super().__call__(overrides, *args, **kwargs)

    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        """Requeued by submitit after a timeout or preemption (max_num_timeout > 0): resume the job's newest checkpoint
        instead of starting over in its folder."""
        from runner.distributed.env import with_resume_auto

        return super().checkpoint(with_resume_auto(list(sweep_overrides)), *args, **kwargs)


if submitit_launcher is not None:

    class RunnerSlurmLauncher(_TasksAreRanks, submitit_launcher.SlurmLauncher):
        """submitit_slurm, with a job's tasks as the ranks of one run."""

    class RunnerLocalLauncher(_TasksAreRanks, submitit_launcher.LocalLauncher):
        """submitit_local (subprocesses on this machine), with a job's tasks as the ranks of one run."""

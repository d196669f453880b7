"""The task packages' config options on Hydra's search path, beside the framework's groups in runner/conf.

runner/conf holds the framework's groups and options (optimizers, schedulers, precision, loggers...); each task package
keeps its own options in a conf/ folder of the same layout (experiments/sae/conf/model/sae_topk.yaml). Hydra merges a
group's options over every entry of its search path, so `model=sae_topk`, `+experiment=sae_lm` and `--help`'s lists
are as if all the files were in one folder. Hydra finds this plugin by scanning the hydra_plugins namespace package.
"""

import re

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

# One folder of groups per task package. Each is a package (its __init__.py), read through Python's import system
# (pkg://), so an installed runner finds it as a checkout does; a package that is not there is skipped by Hydra.
# Entries are searched in order, runner/conf first: an option name in two folders would be the first one's
# (tests/unit/test_configs.py refuses such a name).
TASK_CONFS = ("pkg://experiments.conf", "pkg://experiments.lm.conf", "pkg://experiments.sae.conf")

# runner's own config folder as Hydra names it: file:///.../runner/conf (python -m runner, an installed runner, the
# compose API on that folder) or pkg://runner.conf (initialize_config_module)
_RUNNER_CONF = re.compile(r"(^|[/\\.])runner[/\\.]conf[/\\]?$")


class TaskConfigs(SearchPathPlugin):
    """Appends TASK_CONFS when runner's config is being composed; another Hydra application in the same environment
    keeps its groups to itself."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        paths = [element.path for element in search_path.get_path()]
        if not any(_RUNNER_CONF.search(path.split("://", 1)[-1]) for path in paths):
            return
        for path in TASK_CONFS:
            if path not in paths:
                search_path.append("runner-tasks", path)

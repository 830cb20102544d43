"""`hydra/launcher=kvsim_joblib`: Hydra's joblib launcher (same options, same loky worker
processes, same `execute_job`), except for what every job shares.

Hydra's own joblib launcher pickles the job context (the config loader, the sweep's config,
the task function and Hydra's singletons) into every job: measured on `kvsim bench sweep`'s
grid, 32 ms of the parent's CPU and 17 ms of a worker's per job. The unpickled singletons
lack Hydra's plugin registry, so every job also rescans every plugin module. Here the
context is pickled once per launch into the sweep directory, each worker loads it once and
keeps it, with the worker's plugin registry, for its later jobs (as the basic launcher keeps
one context for all jobs), and a finished job sends back its status, overrides and return
value without the two full configs.

`kvsim sweep` uses this launcher by default; `hydra/launcher=joblib` selects Hydra's own.
"""

# no `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, and a dataclass with string annotations looks its module up there
import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher

# in the sweep directory while a launch runs (one per launching process); removed after it
CONTEXT_FILE = ".launch-context-{pid}.pkl"


@dataclass
class SharedContextJoblibLauncherConf(JobLibLauncherConf):
    _target_: str = (
        "hydra_plugins.kvsim_sweeper.shared_context_launcher.SharedContextJoblibLauncher")


ConfigStore.instance().store(group="hydra/launcher", name="kvsim_joblib",
                             node=SharedContextJoblibLauncherConf, provider="kvsim")

def parallel_kwargs(joblib_cfg: Any) -> dict[str, Any]:
    """joblib.Parallel's arguments from a joblib launcher's `joblib` config, made as Hydra's
    launcher makes them (backend loky: its threading backend breaks Hydra). The sweep's
    worker warm-up uses the same, so that the launch reuses the warmed processes."""
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg

    kwargs = dict(joblib_cfg)
    kwargs["backend"] = "loky"
    process_joblib_cfg(kwargs)
    return kwargs


# worker process: {context digest: (hydra_context, config, task_function, singleton_state)}
_LOADED: dict[str, tuple[Any, Any, Any, Any]] = {}


def _load_context(path: str, digest: str) -> tuple[Any, Any, Any, Any]:
    context = _LOADED.get(digest)
    if context is None:
        data = Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError(f"{path} changed while its sweep ran; rerun the sweep to "
                               "resume it")
        _LOADED.clear()  # one launch at a time per worker: drop an older launch's context
        context = _LOADED[digest] = pickle.loads(data)
        # Hydra leaves its plugin registry out of the pickled state, and `execute_job`'s
        # set_state rebuilds it (a scan of every plugin module) when the state lacks it: the
        # worker's registry, built by its warm-up, goes into the state that every job of
        # this worker will set
        from hydra.core.plugins import Plugins
        from hydra.core.singleton import Singleton

        plugins = Singleton._instances.get(Plugins)
        if plugins is not None:
            context[3]["instances"].setdefault(Plugins, plugins)
    return context


def execute_job(idx: int, overrides: list[str], context_path: str, digest: str) -> Any:
    """One job on a worker: Hydra's joblib `execute_job` with the shared context loaded
    once per worker; the returned JobReturn drops the configs the parent never reads."""
    from hydra_plugins.hydra_joblib_launcher._core import execute_job as hydra_execute_job

    hydra_context, config, task_function, singleton_state = _load_context(context_path,
                                                                          digest)
    ret = hydra_execute_job(idx, overrides, hydra_context, config, task_function,
                            singleton_state)
    ret.cfg = None
    ret.hydra_cfg = None
    return ret


class SharedContextJoblibLauncher(JoblibLauncher):
    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        """As hydra_joblib_launcher._core.launch, with the context sent once per worker."""
        import logging

        import cloudpickle  # joblib's own dependency: pickles the task function's closure
        from hydra.core.singleton import Singleton
        from hydra.core.utils import configure_log, filter_overrides, setup_globals
        from joblib import Parallel, delayed

        assert self.config is not None and self.task_function is not None
        assert self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        joblib_cfg = parallel_kwargs(self.joblib)
        log = logging.getLogger(__name__)
        log.info("Joblib.Parallel(%s) is launching %d jobs (shared context sent once per "
                 "worker)", ",".join(f"{k}={v}" for k, v in joblib_cfg.items()),
                 len(job_overrides))
        for idx, overrides in enumerate(job_overrides):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        data = cloudpickle.dumps((self.hydra_context, self.config, self.task_function,
                                  Singleton.get_state()))
        path = sweep_dir / CONTEXT_FILE.format(pid=os.getpid())
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        try:
            runs = Parallel(**joblib_cfg)(
                delayed(execute_job)(initial_job_idx + idx, list(overrides), str(path), digest)
                for idx, overrides in enumerate(job_overrides))
        finally:  # every job has returned (or the launch is interrupted): no reader is left
            path.unlink(missing_ok=True)
        return list(runs)

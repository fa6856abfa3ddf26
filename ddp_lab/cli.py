"""What every ddp_lab command shares: the Hydra entry, its resolvers, the conf dir, logging.

    run_hydra_app(task, "config")   # compose conf/config.yaml + overrides, call task(cfg, run_dir)

A `ConfigError` (bad input) becomes one line on stderr and exit code 2; a `TrainingError` (a hang,
a dead peer, a NaN under train.nonfinite=stop, diverged replicas) one line and exit code 3. Neither
prints a traceback: the message names the key or the rank and says what to do.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import tempfile

from omegaconf import OmegaConf

from ddp_lab.config import neutral_keys, register_configs
from ddp_lab.dist import under_torchrun
from ddp_lab.errors import ConfigError, TrainingError

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
log = logging.getLogger("ddp_lab")


def register_resolvers() -> None:
    """The `${ddp_lab.*:}` resolvers conf/ uses (before Hydra composes anything)."""
    if OmegaConf.has_resolver("ddp_lab.run_name"):
        return
    # Deterministic run dir shared by all ranks: the overrides, or "default".
    OmegaConf.register_new_resolver("ddp_lab.run_name", lambda s: s or "default")
    # The keys left out of the run dir's name: those that change nothing about a run.
    OmegaConf.register_new_resolver("ddp_lab.neutral_keys", neutral_keys)
    # Only rank 0 writes Hydra's .hydra/ record, and only into a new run dir (or one started over
    # with train.resume=never): a resumed or refused start leaves the first one intact.
    OmegaConf.register_new_resolver("ddp_lab.rank0_only", _hydra_record_dir)


def _hydra_record_dir(subdir: str, *, _root_):
    if os.environ.get("RANK", "0") != "0":
        return None
    try:
        out = _root_.hydra.runtime.output_dir
        if (_root_.train.resume != "never"
                and os.path.exists(os.path.join(out, subdir, "config.yaml"))):
            return None
    except Exception:  # no run dir yet (or no train node): Hydra's default
        pass
    return subdir


def compose(overrides=(), config_name: str = "config"):
    """conf/`config_name`.yaml + `overrides`, composed from code as the command line would compose
    them (the sweep's points, the benchmarks, the probe, the tests). Inside a running Hydra app it
    uses that app's initialised conf dir; elsewhere Hydra is initialised for the call."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    register_resolvers()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name, overrides=list(overrides))
    with initialize_config_dir(CONF_DIR, version_base=None):
        return hydra_compose(config_name, overrides=list(overrides))


def run_hydra_app(task, config_name: str) -> None:
    """Run `task(cfg, run_dir)` as a Hydra app with conf/`config_name`.yaml."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    register_configs()
    register_resolvers()
    # A crash inside a C++ library (a segfault in a collective, say) then prints every Python
    # thread's stack to stderr: where the training and communication threads were.
    faulthandler.enable()

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base=None)
    def entry(cfg):
        try:
            if HydraConfig.get().mode == RunMode.MULTIRUN and under_torchrun():
                raise ConfigError("--multirun inside torchrun would start a sweep on every rank; "
                                  "sweep world sizes with `python -m ddp_lab.scale` instead")
            task(cfg, HydraConfig.get().runtime.output_dir)
        except ConfigError as e:
            _say(e, every_rank=False)
            sys.exit(2)
        except TrainingError as e:
            _say(e, every_rank=e.every_rank)
            sys.exit(3)

    entry()


def _say(error: Exception, every_rank: bool) -> None:
    """One line on stderr: from rank 0, or from every rank where each one's message differs."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr, flush=True)


def setup_logging(run_dir: str, is_main: bool) -> None:
    """Rank 0 logs INFO to stderr and run_dir/train.log; the other ranks warnings and errors."""
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stderr)]
    if is_main:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)


# ---- the run dir, before Hydra writes into it -------------------------------------------------

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra < 1.1
    Callback = object


def unwritable(run_dir: str) -> str | None:
    """Why `run_dir` cannot hold a run (None if it can): made if missing, then a probe file.
    (A permission check alone is not enough: root passes os.access on any mode bits.)"""
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=run_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{e.strerror or e} ({e.filename or run_dir})"
    return None


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml: hydra.callbacks): refuse an unwritable run dir with one
    line before Hydra's own mkdir fails with a traceback, and before any training starts."""

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        # The default run dir interpolates ${hydra:job.override_dirname}, which resolves only once
        # HydraConfig is set, and Hydra sets it after this callback (in run_job, again).
        HydraConfig.instance().set_config(config)
        run_dir = str(config.hydra.run.dir)
        problem = unwritable(run_dir)
        if problem:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: the run dir {run_dir!r} is not writable: {problem}. Choose another "
                      "with hydra.run.dir=<dir>", file=sys.stderr, flush=True)
            sys.exit(2)

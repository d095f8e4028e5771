"""`python -m train conf=<recipe> [overrides]`, and forge-train: train.py for an installed package, which has no
train.py beside its conf/."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from common.config import PROJECT_ROOT, exit_on_user_error, run_cli


def _train(cfg: DictConfig) -> None:
    import train.run  # after Hydra has parsed the command line: a typo fails before the slow imports

    train.run.run(cfg, Path(HydraConfig.get().runtime.output_dir))


_train.__module__ = "train"  # Hydra names the job after the task's module: the run's log is train.log, as train.py's
main = hydra.main(config_path=str(PROJECT_ROOT / "conf"), config_name="config", version_base="1.3")(
    exit_on_user_error(_train))

if __name__ == "__main__":
    run_cli(main)

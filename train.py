"""Train a drafter (or the default target): `python train.py conf=eagle3 [overrides]`."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from common.config import exit_on_user_error, run_cli


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    import train.run  # after Hydra has parsed the command line: a typo fails before the slow imports

    train.run.run(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    run_cli(main)

"""`python -m inference drafter=<export dir> [target=...] [quant=int8|int4|gguf|...] [eval=mtbench|sharegpt|stdlib]
[eval.path=prompts.jsonl] [max_new_tokens=N] [temperature=T] [k=K] [out=DIR]`: speculative
decoding and its report."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from common.config import PROJECT_ROOT, exit_on_user_error, run_cli, to_dataclass
from inference import evalsets, report


# Its own config folder (conf/eval and conf/quant linked in): `target=<path>` is a plain value here, not the
# training group.
@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "inference"), config_name="config", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(report.InferenceConfig, cfg)
    drafter, target = report.load_pair(cfg.drafter, cfg.target, cfg.quant, cfg.drafter_quant)
    result = report.measure(target, drafter, evalsets.prompts(cfg.eval, target, cfg.max_new_tokens), cfg)
    out_dir = Path(cfg.out or HydraConfig.get().runtime.output_dir)
    path = report.write(result, out_dir)
    report.log_to_wandb(result, cfg.logger, out_dir)
    print(f"report: {path}")


if __name__ == "__main__":
    run_cli(main)

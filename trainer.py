"""Fine-tune a decoder LM of any supported family (docs/families.md: Llama, Qwen, Gemma, DeepSeek, gpt-oss and the
others of models/families/, dense or with experts) with DeepSpeed pipeline x tensor x context x expert x data
parallelism: SFT on text, prompt/response or chat rows, or preference tuning (objective=dpo), with or without LoRA.

    deepspeed --hostfile HOSTS trainer.py experiment=RECIPE model_name_or_path=CKPT train_file=... [overrides]
    deepspeed --num_gpus N trainer.py model_name_or_path=CKPT num_stages=2 train_file=... [overrides]
    torchrun --nproc_per_node N trainer.py ...        # works as well; srun too (examples/slurm/)
    python trainer.py ...                             # one rank

Configuration: conf/config.yaml and its groups (model/, data/, deepspeed/, experiment/), checked
against the dataclasses in schema/ (schema/train.py). `python trainer.py --help` lists them.
"""

from __future__ import annotations

import re
import sys

# NOTE: the deepspeed launcher appends --local_rank=N (LOCAL_RANK is also in the environment) and
# hydra rejects it: strip it before hydra parses sys.argv.
sys.argv = [a for i, a in enumerate(sys.argv) if i == 0 or not re.fullmatch(r"--local[_-]rank(=\d+)?", a)]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from schema.compose import CONF_DIR, check_overrides, with_plan_model  # noqa: E402
from schema.train import TrainConfig, register_configs  # noqa: E402

register_configs()
_problem = check_overrides(sys.argv[1:], CONF_DIR)
if _problem:
    print(f"trainer: error: {_problem}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from training.distributed import shutdown_distributed
    from training.errors import USER_ERRORS
    from training.loop import Trainer

    try:
        cfg: TrainConfig = with_plan_model(OmegaConf.to_object(dict_cfg))
    except ValueError as e:  # an unknown plan_model preset
        sys.stderr.write(f"trainer: error: {e}\n")
        sys.exit(2)
    try:
        Trainer(cfg).run()
    except USER_ERRORS as e:
        # NOTE: one write per line: every rank prints it, and print()'s separate newline would interleave them.
        sys.stderr.write(f"trainer: error: {e}\n")
        sys.stderr.flush()
        sys.exit(2)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()

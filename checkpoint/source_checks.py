"""Checks of a Hugging Face directory before and while it is converted.

`plan_conversion` runs every check before anything is written (the trainer's conversion at load);
`SourceCheck` runs transformers' reading of config.json and then the tokenizer check in a thread, so that
`convert2ckpt.py` writes layers while the tokenizer is checked.
"""

from __future__ import annotations

import os
import threading

from checkpoint.dequantize import hub_sources, is_scale
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import read_model_config, validate
from models.config import ConfigFields, differing_field
from models.key_table import all_layer_keys, hf_key_to_layer, hub_index, is_carried
from models.tokenizer import check_tokenizer_fits, has_tokenizer, load_tokenizer


def check_tokenizer(hf_dir: str, vocab_size: int) -> int | None:
    """len(tokenizer) must not exceed the embedding rows. Returns len(tokenizer), None if there is none."""
    if not has_tokenizer(hf_dir):
        return None
    try:
        n = len(load_tokenizer(hf_dir, setting="tokenizer"))
        check_tokenizer_fits(n, vocab_size, hf_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return n


def plan_conversion(hf_dir: str):
    """Every check before a conversion writes anything. Returns (config, {layer index: {ours: HF key}}).

    Raises:
        CheckpointError: config, tokenizer, shards or keys do not fit the key table (models/key_table.py).
    """
    config = read_model_config(hf_dir)
    check_tokenizer(hf_dir, config.vocab_size)
    return config, check_keys(hf_dir, config)


def check_keys(hf_dir: str, config) -> dict[int, dict[str, str]]:
    """Every shard complete, every HF key with a home and every home with a key. Returns {layer index:
    {ours: HF key}}. Raises CheckpointError naming the shard or the first missing key."""
    where = validate(hf_dir)
    expected = all_layer_keys(config)
    index = hub_index(config)
    for name, shard_file in where.items():
        if is_carried(name, config) or is_scale(name, config):  # kept aside (carried.py); pieces (dequantize.py)
            continue
        try:
            hf_key_to_layer(name, config, index)
        except KeyError as e:
            raise CheckpointError(f"{os.path.join(hf_dir, shard_file)}: {e.args[0]}") from None
    missing = [hf for keys in expected.values() for hf in keys.values() if hf not in where]
    missing = [hf for hf in missing if any(src not in where for src in hub_sources(hf, config, where))]
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} tensors of the model missing, e.g. {missing[0]}")
    return expected


class SourceCheck:
    """transformers' reading of config.json, then the tokenizer check, in a thread.

    Importing transformers takes 2-3 s; the layer files' key names come from transformers' own layers, so the
    layers wait for the config (`result(tokenizer=False)`), not for the tokenizer, which is checked while they are
    written. The thread's result gates publishing: a tokenizer that does not fit or a config transformers refuses
    stops the conversion (checked after every layer), and a field read differently from transformers
    (`ConfigFields`, read at once) is refused by name, so nothing is ever published on a reading of config.json that
    transformers does not share.
    """

    def __init__(self, hf_dir: str):
        self.hf_dir, self.config, self.error = hf_dir, None, None
        self.config_read = threading.Event()  # set once the config is read (or failed), before the tokenizer check
        self.thread = threading.Thread(target=self._run, name="source-check", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.config = read_model_config(self.hf_dir)
            self.config_read.set()
            check_tokenizer(self.hf_dir, self.config.vocab_size)
        except CheckpointError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = CheckpointError(f"{self.hf_dir}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        finally:
            self.config_read.set()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def result(self, light: ConfigFields | None = None, tokenizer: bool = True):
        """transformers' config, once the checks passed (`tokenizer=False`: once it is read, the tokenizer's check
        still running); `light` must read the file the same way."""
        if tokenizer:
            self.thread.join()
        self.config_read.wait()
        self.raise_if_failed()
        differs = light and differing_field(light, self.config)
        if differs:
            raise CheckpointError(f"{os.path.join(self.hf_dir, 'config.json')}: read as {differs}; not converted")
        return self.config

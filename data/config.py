"""The data part of the run configuration (`data` group, conf/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    text_key: str = "text"  # the column of plain-text rows (every token a target)
    prompt_key: str = "prompt"  # the column of a prompt (no targets) ...
    response_key: str = "response"  # ... and of its response (the targets)
    messages_key: str = "messages"  # chat rows: [{role, content}, ...] rendered with the tokenizer's chat template
    train_weights: list[float] | None = None  # one per train_file entry: mix the files by these weights
    cache_dir: str | None = None  # tokenized stores live here (default: output_dir/data_cache; "": only for the run)
    tokenize_workers: int = 0  # tokenize in this many processes (0/1: in the building rank itself)
    add_eos_to_response: bool = True  # so the model learns where an answer ends
    num_workers: int = 0  # DataLoader worker processes per data rank (0: in the rank itself)
    packing: bool = False  # several rows per seq_length row, attention and labels kept inside each row
    # Pretraining-style: documents end to end (EOS between them) cut into seq_length blocks, attention per document.
    concatenate: bool = False

    @property
    def documents_share_rows(self) -> bool:
        """Rows hold several documents (position_ids restart at each): packing or concatenation."""
        return self.packing or self.concatenate

"""The data part of the run configuration (`data` group, conf/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schema.choice import Choice

SEQUENCES_PER_PAIR = 2  # a preference pair runs through the model as two sequences: chosen, then rejected


class DataFormat(Choice):
    auto = "auto"  # per file, from its first row's keys (data/formats.py)
    native = "native"  # text, prompt/response, messages, preference pairs
    alpaca = "alpaca"  # LLaMA-Factory's alpaca: instruction, input, output, system, history
    sharegpt = "sharegpt"  # LLaMA-Factory's ShareGPT: conversations of {from, value}


class TrainOn(Choice):
    all_assistant_turns = "all_assistant_turns"  # every assistant turn of a chat row is a target
    last_assistant_turn = "last_assistant_turn"  # only the last one (the earlier turns are context)


@dataclass
class DataConfig:
    text_key: str = "text"  # the column of plain-text rows (every token a target)
    prompt_key: str = "prompt"  # the column of a prompt (no targets) ...
    response_key: str = "response"  # ... and of its response (the targets)
    messages_key: str = "messages"  # chat rows: [{role, content}, ...] rendered with the tokenizer's chat template
    train_on: TrainOn = TrainOn.all_assistant_turns  # chat rows: which assistant turns are targets
    chat_template: str | None = None  # a Jinja file or the template itself, instead of the tokenizer's own
    # Passed to the chat template on every rendering (e.g. {enable_thinking: false} for Qwen3's and Qwen3.5's).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chosen_key: str = "chosen"  # preference pairs: the preferred completion (a string or messages)
    rejected_key: str = "rejected"  # ... the other one
    format: DataFormat = DataFormat.auto  # how files are read; auto: detected per file (docs/training.md)
    instruction_key: str = "instruction"  # alpaca: the user turn is instruction + "\n" + input
    input_key: str = "input"  # alpaca: left out of the user turn when empty
    output_key: str = "output"  # alpaca: the assistant turn (the targets)
    system_key: str = "system"  # alpaca and ShareGPT: the system turn
    history_key: str = "history"  # alpaca: earlier [instruction, response] pairs, before the user turn
    conversations_key: str = "conversations"  # ShareGPT: the turns
    role_tag: str = "from"  # ShareGPT: who speaks in a turn
    content_tag: str = "value"  # ShareGPT: what a turn says
    user_tag: str = "human"  # ShareGPT: the user's turns
    assistant_tag: str = "gpt"  # ShareGPT: the assistant's turns (the targets)
    system_tag: str = "system"  # ShareGPT: a first turn that is the system prompt
    function_tag: str = "function_call"  # ShareGPT: an assistant tool call (JSON {name, arguments}; a target)
    observation_tag: str = "observation"  # ShareGPT: a tool's answer (the chat template's tool role)
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

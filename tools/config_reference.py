"""docs/configuration.md, generated from the config dataclasses: every key, its default and one line.

    python -m tools.config_reference            # rewrite docs/configuration.md
    python -m tools.config_reference --check    # exit 1 when the page differs from the dataclasses

The line for a key is the comment on its field (trailing, else the comment lines just above it; from `NOTE:`
on, comments are for readers of the code and left out). tests/test_docs.py keeps the page current and every
key described.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
from enum import Enum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "configuration.md")

HEADER = """# Configuration reference

Every key of the run configuration, its default and what it does, generated from the dataclasses
(`python -m tools.config_reference`; `tests/test_docs.py` fails when this page is stale). Precedence:
dataclass defaults < `conf/config.yaml` and the groups it composes < an `experiment=` recipe < command-line
overrides (`trainer.py num_stages=2 optim.beta2=0.99`). An unknown key, a wrong type or an unknown preset is
a one-line error before anything starts, and every check of values runs (`schema/checks.py`,
`training/validate.py`) before any data or weight is touched. How the settings fit together: [training](training.md),
[parallelism](parallelism.md), [LoRA and preference tuning](lora_and_preference.md).
"""


def field_comments(cls) -> dict[str, str]:
    """field name -> its comment in `cls`'s source (trailing, else the block above; NOTE: lines left out)."""
    lines, _ = inspect.getsourcelines(cls)
    tree = ast.parse(inspect.cleandoc("".join(lines)) if lines[0].startswith(" ") else "".join(lines))
    body = tree.body[0].body
    text = [line.rstrip("\n") for line in lines]
    out = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        line = text[node.lineno - 1]
        trailing = _comment(line)
        above = []
        i = node.lineno - 2
        while i >= 0 and text[i].strip().startswith("#"):
            above.insert(0, text[i].strip().lstrip("#").strip())
            i -= 1
        out[node.target.id] = (trailing or " ".join(above)).split("NOTE:")[0].strip()
    return out


def _comment(line: str) -> str:
    """The `# ...` part of a source line outside string literals ('' when none)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i + 1 :].strip()
    return ""


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _choices(f: dataclasses.Field, cls) -> str:
    hint = inspect.get_annotations(cls, eval_str=True).get(f.name)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return " Choices: " + ", ".join(f"`{m.value}`" for m in hint) + "."
    return ""


def rows(cls, prefix: str = ""):
    """(key, default, description) for every field of `cls`, nested dataclasses flattened as `prefix.key`."""
    comments = field_comments(cls)
    nested = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            nested.append((f.name, type(sub)))
            continue
        yield prefix + f.name, _default(f), (comments.get(f.name, "") + _choices(f, cls)).strip()
    for name, sub_cls in nested:
        yield from rows(sub_cls, prefix + name + ".")


def presets() -> list[tuple[str, list[str]]]:
    conf = os.path.join(ROOT, "conf")
    groups = sorted(g for g in os.listdir(conf) if os.path.isdir(os.path.join(conf, g)))
    return [(g, sorted(f[:-5] for f in os.listdir(os.path.join(conf, g)) if f.endswith(".yaml"))) for g in groups]


def render() -> str:
    from schema.train import TrainConfig

    sections: dict[str, list[tuple[str, str, str]]] = {}
    for key, default, what in rows(TrainConfig):
        group = key.split(".", 1)[0] if "." in key else ""
        sections.setdefault(group, []).append((key, default, what))
    out = [HEADER]
    out.append("## Presets\n")
    out.append("A group on the command line picks a file of `conf/` (`model=llama2_7b`, `deepspeed=bf16_zero1`):\n")
    out.append("| group | presets |\n|---|---|")
    for group, names in presets():
        out.append(f"| `{group}=` | {', '.join(f'`{n}`' for n in names)} |")
    out.append("")
    for group, items in sections.items():
        out.append(f"## {'`' + group + '.*`' if group else 'Run'}\n")
        out.append("| key | default | what it does |\n|---|---|---|")
        for key, default, what in items:
            out.append(f"| `{key}` | {default} | {what.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    sys.path.insert(0, ROOT)
    text = render()
    if "--check" in argv:
        with open(PAGE) as f:
            if f.read() != text:
                print(f"{PAGE} is stale: run python -m tools.config_reference", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

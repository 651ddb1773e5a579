"""Command-line flags generated from the config dataclasses, so flags map 1:1 onto fields;
each flag's help (and choices) is the field's metadata (``engine.config.flag``).

Used by every entry point that builds an engine (`tandem generate`, the worker processes).
Pure Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

# Flags that users know under a second name from vLLM / SGLang.
_ALIASES = {"max_num_seqs": ["--max-running-requests"],
            "gpu_memory_utilization": ["--mem-fraction-static"]}


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--kebab-name`` flag per field of ``cls`` (booleans get ``--no-...``)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-")] + _ALIASES.get(f.name, [])
        tp = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "") + f" (default: {f.default})"
        if tp is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=tp, default=f.default, help=help_text,
                               choices=f.metadata.get("choices"))


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Build ``cls`` from the parsed flags of its fields; raises ValueError when invalid."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def config_to_args(config: Any, skip: tuple[str, ...] = (), changed_only: bool = False) -> list[str]:
    """The flags that ``add_config_args`` + ``config_from_args`` turn back into ``config``
    (for spawning a process with the same settings); ``changed_only``: only the fields that
    differ from their defaults."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value is None or (changed_only and value == f.default):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv

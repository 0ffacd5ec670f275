"""Other tools' command lines, read as ours before click parses them.

People paste what they know: the reference tutorial's MindIE and MindFormers flags (`--max_seq_len=2048`,
`--device_id=0`, `--kv_cache_compression_ratio=0.5`, `--run_mode=train`), its `preprocess.py` flags, vLLM's
`--gpu-memory-utilization` and `--lora-modules`. Each such token is translated and one line on stderr says what
it became, or it is refused with our equivalent. Tokens we already accept pass through untouched, and so does
everything after `--`.

- Any command: `--some_option` -> `--some-option` when the command has that option; a boolean flag written
  `--flag=true|false` -> `--flag` / `--no-flag`.
- Per command: the rules in `compat_rules.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlc.cli.compat_rules import COMMAND_RULES, PREPASSES, Rule, parse_bool
from mlc.errors import ConfigError


@dataclass
class Translation:
    argv: list[str]
    notes: list[str] = field(default_factory=list)


def translate_argv(root: Any, argv: list[str]) -> Translation:
    """`argv` (without the program name) in our spellings, and one note per token that was translated. `root` is
    the app's click group (typer's own copy of click, so it is read by duck typing: `.commands`, `.params`)."""
    argv = list(argv)
    if not argv or not _is_group(root):
        return Translation(argv)
    path, cmd = _subcommand(root, argv)
    if cmd is None:
        return Translation(argv)
    head, rest = argv[: len(path)], argv[len(path):]
    notes: list[str] = []
    prepass = PREPASSES.get(path[0])
    if prepass is not None:
        rest = prepass(rest, notes)
    out = _translate_tokens(cmd, COMMAND_RULES.get(path[0], {}), rest, notes)
    return Translation(head + out, notes)


def _is_group(cmd: Any) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)


def _subcommand(root: Any, argv: list[str]) -> tuple[list[str], Any]:
    """The command path (`["bench", "kv"]`) and the command it names, or ([], None) for `--help` and typos."""
    path: list[str] = []
    cmd = root
    for token in argv:
        if not _is_group(cmd):
            break
        sub = cmd.commands.get(token)
        if sub is None:
            return (path, cmd) if path else ([], None)
        path.append(token)
        cmd = sub
    return (path, cmd) if path else ([], None)


def _options(cmd: Any) -> dict[str, Any]:
    return {name: p for p in cmd.params if getattr(p, "param_type_name", "") == "option"
            for name in (*p.opts, *p.secondary_opts)}


def _translate_tokens(cmd: Any, rules: dict[str, Rule], rest: list[str], notes: list[str]) -> list[str]:
    options = _options(cmd)
    out: list[str] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            return out + rest[i:]
        flag, eq, value = token.partition("=")
        if not token.startswith("--") or (flag in options and not options[flag].is_flag):
            take = 2 if token.startswith("--") and not eq else 1  # our option and its value, untouched
            out += rest[i:i + take]
            i += take
            continue
        if flag in rules:
            i = _apply_rule(rules[flag], flag, value if eq else None, rest, i, out, notes)
            continue
        out += _generic(options, flag, value if eq else None, token, notes)
        i += 1
    return out


def _apply_rule(rule: Rule, flag: str, value: str | None, rest: list[str], i: int, out: list[str],
                notes: list[str]) -> int:
    """Run `rule` on the flag at `rest[i]`; returns the index of the next token."""
    i += 1
    if rule.arity == "one" and value is None:
        if i >= len(rest):
            raise ConfigError(f"{flag} needs a value")
        value, i = rest[i], i + 1
    elif rule.arity == "bool" and value is None and i < len(rest) and rest[i].lower() in ("true", "false"):
        value, i = rest[i], i + 1
    elif rule.arity == "many":
        values = [value] if value is not None else []
        while i < len(rest) and not rest[i].startswith("-"):
            values.append(rest[i])
            i += 1
        if not values:
            raise ConfigError(f"{flag} needs at least one value")
        value = "\0".join(values)
    shown = flag if value is None else f"{flag} {value.replace(chr(0), ' ')}"
    tokens, note = rule.apply(value)
    out += tokens
    notes.append(f"{shown} -> {note}")
    return i


def _generic(options: dict[str, Any], flag: str, value: str | None, token: str, notes: list[str]) -> list[str]:
    """`--max_seq_len=2048` -> `--max-seq-len 2048`; `--strict-input=true` -> `--strict-input`."""
    ours = flag if flag in options else flag.replace("_", "-")
    option = options.get(ours)
    if option is None:
        return [token]  # click reports it as an unknown option, with its suggestions
    if option.is_flag and value is not None:
        on = parse_bool(flag, value)
        if on:
            tokens = [option.opts[0]]
        elif option.secondary_opts:
            tokens = [option.secondary_opts[0]]
        else:
            raise ConfigError(f"{flag}={value}: the flag {option.opts[0]} is off unless given; leave it out")
        notes.append(f"{token} -> {tokens[0]}")
        return tokens
    if ours == flag:
        return [token]
    tokens = [ours] if value is None else [ours, value]
    notes.append(f"{token} -> {' '.join(tokens)}")
    return tokens


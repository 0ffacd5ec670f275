"""Where LoRA adapters may be loaded from: only inside the directories given with `--lora-dir` and
`--allowed-lora-paths`. A path is refused if it holds `..`, or if it resolves (symlinks followed) outside them; a
name the resolver looks up in a `--lora-dir` must be one plain path component."""

from __future__ import annotations

import re
from pathlib import Path

from mlc.errors import InvalidRequestError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


class LoRAPathError(InvalidRequestError):
    http_status = 403
    error_type = "lora_path_not_allowed"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise InvalidRequestError(f"lora_name {name!r} is not a valid adapter name: use 1-128 letters, digits and "
                                  "._:@+- starting with a letter or digit", field="lora_name")
    return name


class LoRAPaths:
    def __init__(self, lora_dirs: list[str], allowed: list[str]) -> None:
        self.lora_dirs = [Path(d).expanduser().resolve() for d in lora_dirs]
        self.roots = [*self.lora_dirs, *(Path(d).expanduser().resolve() for d in allowed)]

    def check(self, raw: str) -> Path:
        """The real path of `raw` (relative: inside the first --lora-dir), if inside an allowed directory."""
        if not self.roots:
            raise LoRAPathError("this server loads adapters from no directory; start it with --lora-dir DIR or "
                                "--allowed-lora-paths DIR", field="lora_path")
        if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
            raise InvalidRequestError("lora_path must be a non-empty path", field="lora_path")
        given = Path(raw).expanduser()
        if ".." in given.parts:
            raise LoRAPathError(f"lora_path {raw!r} holds '..'; give a path inside an allowed directory",
                                field="lora_path")
        if not given.is_absolute():
            given = (self.lora_dirs or self.roots)[0] / given
        real = given.resolve()
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            raise LoRAPathError(f"lora_path {raw!r} is outside the allowed directories ({self.describe()}); a "
                                "symlink out of them counts as outside", field="lora_path")
        if not real.is_dir():
            raise InvalidRequestError(f"lora_path {raw!r} is not a directory holding a PEFT adapter",
                                      field="lora_path")
        return real

    def find(self, name: str) -> Path | None:
        """DIR/NAME in the first --lora-dir that holds it as an adapter (the resolver), checked like `check`."""
        if not NAME.match(name) or ".." in name:
            return None
        for root in self.lora_dirs:
            if (root / name / "adapter_config.json").is_file():
                return self.check(str(root / name))
        return None

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots)

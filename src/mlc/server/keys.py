"""API keys as tenants: the key file (`--api-key-file`, `api_key_file:`), keys stored as SHA-256 hashes, each with a
name and optional limits.

    keys:
      - name: alice
        key_sha256: 2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824
        requests_per_minute: 60
        tokens_per_minute: 20000
        max_concurrent: 4

(a bare list of entries, or the same in JSON, works too). `mlc-cli keys add NAME` prints a new key once and its
entry. A key is found by hashing what the client sent and comparing it with every entry's hash in constant time;
the name, never the key, is what the metrics, the audit log and the log see.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlc.errors import ConfigError

log = logging.getLogger("mlc.server")

KEY_PREFIX = "mlc-"


class KeyEntry(BaseModel):
    """One key of the file (the limits are per rolling minute; None: unlimited)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.@-]{1,64}$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion tokens
    max_concurrent: int | None = Field(None, ge=1)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def entry_text(name: str, key: str, **limits: int | None) -> str:
    """The YAML list item for `key` under `name` (the key itself appears only as its hash)."""
    try:
        entry = KeyEntry(name=name, key_sha256=hash_key(key), **limits)
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    return yaml.safe_dump([entry.model_dump(exclude_none=True)], sort_keys=False)


def _entry_node(tree: yaml.Node | None, index: int) -> yaml.Node | None:
    """The YAML node of the `index`th entry of the file's key list (for line numbers)."""
    if isinstance(tree, yaml.MappingNode):
        tree = next((v for k, v in tree.value if getattr(k, "value", None) == "keys"), None)
    if isinstance(tree, yaml.SequenceNode) and index < len(tree.value):
        return tree.value[index]
    return None


def _line(node: yaml.Node | None, field: str | None = None) -> int | None:
    """The 1-based line of an entry, or of one of its fields when the entry has it."""
    if node is None:
        return None
    if field is not None and isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if getattr(k, "value", None) == field:
                return k.start_mark.line + 1
    return node.start_mark.line + 1


def parse_key_file(text: str, source: str) -> list[KeyEntry]:
    """The entries of a key file's text; ConfigError naming the line and the field for anything wrong."""
    fix = "fix the key file (see the README, 'API keys as tenants')"
    try:
        data = yaml.safe_load(text)
        tree = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ConfigError(f"{where}: not valid YAML or JSON ({getattr(e, 'problem', e)}); {fix}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise ConfigError(f"{source}: expected a list of keys (or 'keys:' holding one); {fix}")
    entries: list[KeyEntry] = []
    names: set[str] = set()
    hashes: set[str] = set()
    for i, raw in enumerate(data):
        node = _entry_node(tree, i)

        def at(field: str | None = None) -> str:
            line = _line(node, field)  # noqa: B023 - used within this iteration
            return f"{source}:{line}" if line else f"{source}: key {i + 1}"  # noqa: B023

        where = at()
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: each key is a mapping with name and key_sha256; {fix}")
        if "key" in raw:
            raise ConfigError(f"{at('key')}: a plain 'key' is not stored in the file, only its hash: use "
                              "'key_sha256' (`mlc-cli keys hash` prints it)")
        try:
            entry = KeyEntry.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "entry"
            raise ConfigError(f"{at(field)}: field '{field}': {first['msg']}; {fix}") from None
        if entry.name in names:
            raise ConfigError(f"{at('name')}: the name {entry.name!r} is used twice; names must be unique")
        if entry.key_sha256 in hashes:
            raise ConfigError(f"{at('key_sha256')}: key {entry.name!r} has the same key_sha256 as an earlier key")
        names.add(entry.name)
        hashes.add(entry.key_sha256)
        entries.append(entry)
    return entries


def load_key_file(path: str | Path) -> list[KeyEntry]:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--api-key-file {p}: cannot read it ({e.strerror})") from None
    return parse_key_file(text, str(p))


@dataclass(frozen=True)
class Match:
    """Who a valid key is: an entry of the key file, or (entry None) one of the plain --api-key keys."""

    entry: KeyEntry | None

    @property
    def name(self) -> str | None:
        return self.entry.name if self.entry is not None else None


class KeyRing:
    """The plain keys and the key file's entries; `reload` re-reads the file (a bad file keeps the old keys)."""

    def __init__(self, plain: list[str], path: str | None = None):
        self.plain = [k.encode() for k in plain]
        self.path = path
        self.entries: list[KeyEntry] = load_key_file(path) if path else []
        self._digests = [bytes.fromhex(e.key_sha256) for e in self.entries]

    @property
    def enabled(self) -> bool:
        return bool(self.plain or self.path)

    def match(self, key: str) -> Match | None:
        """The key's owner, or None; every stored key is compared, so the time taken tells nothing."""
        given = key.encode()
        digest = hashlib.sha256(given).digest()
        found: Match | None = None
        for stored in self.plain:
            if hmac.compare_digest(given, stored) and found is None:
                found = Match(None)
        for entry, d in zip(self.entries, self._digests):
            if hmac.compare_digest(digest, d) and found is None:
                found = Match(entry)
        return found

    def reload(self) -> bool:
        """Re-read the key file; on error log it and keep the keys in use. True when the new keys took effect."""
        if not self.path:
            return False
        try:
            entries = load_key_file(self.path)
        except ConfigError as e:
            log.error("reloading the API key file failed, keeping the %d key(s) in use: %s", len(self.entries),
                      e.message)
            return False
        self.entries, self._digests = entries, [bytes.fromhex(e.key_sha256) for e in entries]
        log.info("reloaded the API key file %s: %d key(s): %s", self.path, len(entries),
                 json.dumps([e.name for e in entries]))
        return True

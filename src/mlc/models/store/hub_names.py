"""What a hub id names: `[hf:|modelscope:]ORG/NAME[@REVISION][:QUANT]` or a GLM short name (`glm-4.5-air`), the
repo and revision it asks for, and the store name the pulled model is kept under (`$MLC_HOME/models/<name>`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlc.errors import ConfigError

SOURCES = ("hf", "modelscope")
DEFAULT_BRANCH = {"hf": "main", "modelscope": "master"}
KIND = {"hf": "hf-hub", "modelscope": "modelscope"}  # the manifest's source kind
REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
REVISION = re.compile(r"[\w][\w./-]*")
QUANT = re.compile(r"[A-Za-z0-9][\w.-]*")
GRAMMAR = "[hf:|modelscope:]ORG/NAME[@REVISION][:QUANT] or a short name"


@dataclass(frozen=True)
class ShortName:
    """A GLM model by the name the launcher presets and `plan` use. No revision is pinned: none could be checked
    when this table was written (no hub was reachable), so every pull records the commit it resolved instead."""

    name: str
    hf_repo: str
    modelscope_repo: str
    title: str


SHORT_NAMES: dict[str, ShortName] = {s.name: s for s in (
    ShortName("glm-4-9b", "zai-org/glm-4-9b-chat-hf", "ZhipuAI/glm-4-9b-chat-hf",
              "GLM-4-9B-chat in transformers' layout (`glm`), the shape `plan` knows as glm-4-9b"),
    ShortName("glm-4-9b-0414", "zai-org/GLM-4-9B-0414", "ZhipuAI/GLM-4-9B-0414", "GLM-4-9B-0414 (`glm4`)"),
    ShortName("glm-4.5", "zai-org/GLM-4.5", "ZhipuAI/GLM-4.5", "GLM-4.5, 355B MoE (`glm4_moe`)"),
    ShortName("glm-4.5-air", "zai-org/GLM-4.5-Air", "ZhipuAI/GLM-4.5-Air", "GLM-4.5-Air, 106B MoE (`glm4_moe`)"),
    ShortName("glm-4.6", "zai-org/GLM-4.6", "ZhipuAI/GLM-4.6", "GLM-4.6, 355B MoE (`glm4_moe`)"),
    ShortName("glm-4.7", "zai-org/GLM-4.7", "ZhipuAI/GLM-4.7", "GLM-4.7, MoE (`glm4_moe`)"),
    ShortName("glm-5", "zai-org/GLM-5", "ZhipuAI/GLM-5", "GLM-5, 744B MoE with MLA and DSA (`glm_moe_dsa`)"),
)}


@dataclass(frozen=True)
class HubSpec:
    """One hub id, parsed: where from, which repo, which revision (None: the default branch) and GGUF quant."""

    source: str  # "hf" or "modelscope"
    repo: str
    revision: str | None = None
    quant: str | None = None
    short: str | None = None  # the short name it was given as

    @property
    def branch(self) -> str:
        return self.revision or DEFAULT_BRANCH[self.source]

    @property
    def kind(self) -> str:
        return KIND[self.source]

    @property
    def store_name(self) -> str:
        """`glm-4.5-air`, `zai-org--GLM-4.5-Air`, `modelscope--ZhipuAI--GLM-4.5`, `org--name-GGUF--Q4_K_M`: one
        store entry per model and quant (the revision is the manifest's, not the name's)."""
        base = self.short or self.repo.replace("/", "--")
        if self.source != "hf" and not self.short:
            base = f"{self.source}--{base}"
        return f"{base}--{self.quant.upper()}" if self.quant else base

    def __str__(self) -> str:
        prefix = "" if self.source == "hf" else f"{self.source}:"
        revision = f"@{self.revision}" if self.revision else ""
        quant = f":{self.quant}" if self.quant else ""
        return f"{prefix}{self.short or self.repo}{revision}{quant}"

    def url(self, endpoint: str) -> str:
        return f"{endpoint.rstrip('/')}/{self.repo}"


def parse_spec(text: str, source: str | None = None) -> HubSpec | None:
    """`text` as a hub id; None when it is not one (a path, a store or known model name). `source` (`--source`)
    picks the hub for an id without a prefix; a prefix that contradicts it is refused."""
    if source is not None and source not in SOURCES:
        raise ConfigError(f"--source {source!r}: use one of {', '.join(SOURCES)}")
    prefix, sep, rest = text.partition(":")
    if sep and prefix in SOURCES:
        if source is not None and source != prefix:
            raise ConfigError(f"{text!r} names {prefix} but --source says {source}; give one")
        source, text = prefix, rest
        if not _looks_like_spec(text):
            raise ConfigError(f"{prefix}:{text!r} is not a hub id; write {GRAMMAR}")
    elif not _looks_like_spec(text):
        return None
    source = source or "hf"
    body, _, quant = text.partition(":")
    name, at, revision = body.partition("@")
    short = SHORT_NAMES.get(name.lower())
    if (at and not REVISION.fullmatch(revision)) or (quant and not QUANT.fullmatch(quant)) or not (
            short or REPO.fullmatch(name)):
        raise ConfigError(f"{text!r} is not a hub id; write {GRAMMAR} (e.g. zai-org/GLM-4.5-Air@main, "
                          "unsloth/GLM-4.5-Air-GGUF:Q4_K_M, glm-4.5-air)")
    repo = (short.hf_repo if source == "hf" else short.modelscope_repo) if short else name
    return HubSpec(source, repo, revision or None, quant or None, short.name if short else None)


def _looks_like_spec(text: str) -> bool:
    """A repo id or a short name, with any `@revision` or `:quant`; not a path, a .gguf or a .json file."""
    name = text.partition(":")[0].partition("@")[0]
    if name.lower() in SHORT_NAMES:
        return True
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith((".gguf", ".json"))

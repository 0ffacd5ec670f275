"""The model store under `$MLC_HOME/models`: pulling known models (`pulling`, `known_models`) and models from a hub
(`hub_pull`: ids and GLM short names in `hub_names`, file choice in `hub_files`, the Hugging Face Hub in `hub`,
ModelScope in `modelscope_source`), moving a finished model into place (`placing`), what a name, a checkpoint dir, a
hub id or a .gguf file resolves to (`resolve`), each model's manifest and its integrity (`manifest`, `integrity`,
`verifying`), the HF cache (`hf`), paths and listings (`paths`, `listing`).

Its public names are here, so that `from mlc.models import store` reaches all of it."""

from mlc.models.store.hub_names import SHORT_NAMES, parse_spec
from mlc.models.store.integrity import sha256_file
from mlc.models.store.known_models import KNOWN_MODELS
from mlc.models.store.listing import info, list_models
from mlc.models.store.manifest import file_records, read_manifest, sampling_record
from mlc.models.store.paths import MANIFEST, is_pulled
from mlc.models.store.pulling import gguf_source_file, pull
from mlc.models.store.resolve import resolve_model_dir, resolve_tokenizer_dir
from mlc.models.store.verifying import check_at_load, verify

__all__ = ["KNOWN_MODELS", "MANIFEST", "SHORT_NAMES", "check_at_load", "file_records", "gguf_source_file", "info",
           "is_pulled", "list_models", "parse_spec", "pull", "read_manifest", "resolve_model_dir",
           "resolve_tokenizer_dir", "sampling_record", "sha256_file", "verify"]

"""The prefill/decode layout of a cluster file (`pd:` beside `pools: {prefill, decode}`): the threshold below which
a prompt prefills on its decode instance, and each pool's engine overrides on top of the shared serve config. The
two pools must store KV pages in one format (dtype, KV dtype, page size): a decode instance cannot read another
layout's pages, so a mismatch is refused when the file is checked, before anything starts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PD_POOLS = ("prefill", "decode")


class PDPoolEngine(BaseModel):
    """Engine settings one pool's instances override (unset: the serve config's)."""

    model_config = ConfigDict(extra="forbid")

    dtype: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = Field(None, ge=1, le=1024)
    max_batch_size: int | None = Field(None, ge=1)


class PDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold_tokens: int = Field(256, ge=0)  # shorter prompts prefill on the decode instance
    kv_lease_timeout: float = Field(30.0, gt=0)  # seconds a prefill instance keeps pages for the decode instance
    prefill: PDPoolEngine = Field(default_factory=PDPoolEngine)
    decode: PDPoolEngine = Field(default_factory=PDPoolEngine)

    def check_formats(self) -> None:
        for key in ("dtype", "kv_cache_dtype", "page_size"):
            p, d = getattr(self.prefill, key), getattr(self.decode, key)
            if p != d:
                raise ValueError(
                    f"pd: prefill {key} {p if p is not None else '(serve config)'} but decode "
                    f"{d if d is not None else '(serve config)'}: decode instances cannot read the prefill instances' "
                    f"KV pages; give both pools the same {key}")


def check_pd_pools(pools: dict[str, int], pd: PDConfig | None, devices_per_instance: int) -> None:
    """`pools` maps pool name -> its device count. A PD layout needs both pools, each with devices for at least
    one instance, and matching KV formats."""
    present = [p for p in PD_POOLS if p in pools]
    if not present and pd is None:
        return
    if len(present) != 2:
        raise ValueError("a prefill/decode layout needs both pools.prefill and pools.decode (and their devices)")
    for pool in PD_POOLS:
        if pools[pool] < devices_per_instance:
            raise ValueError(f"pools.{pool} has {pools[pool]} device(s), fewer than one instance needs "
                             f"({devices_per_instance}: tensor x pipeline parallel); give it devices")
    if "inference" in pools:
        raise ValueError("pools: give either inference or prefill + decode, not both")
    (pd or PDConfig()).check_formats()

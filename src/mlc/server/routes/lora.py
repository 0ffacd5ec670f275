"""Run-time LoRA adapters, vLLM's routes: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`, served with `--enable-lora-loading`. With API keys configured they
need an `--admin-api-key` (auth.py); paths are checked by `lora_paths.py`, the adapter's files by the engine
(`layers/lora_files.py`) before anything is allocated. A refused load or unload changes nothing: the adapters
already loaded keep serving. `GET /v1/lora_adapters` lists them with their paths, ranks and digests."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Security
from pydantic import BaseModel, ConfigDict, Field

from mlc.errors import InvalidRequestError
from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.lora_paths import check_name
from mlc.server.protocol.responses_doc import ERROR_RESPONSES
from mlc.server.state import ServerState, loaded_engine

router = APIRouter(tags=["LoRA adapters"], dependencies=[Security(bearer_scheme)], responses=ERROR_RESPONSES)


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="The name requests select the adapter by (`model`).")
    lora_path: str = Field(description="The PEFT adapter's directory, inside --lora-dir / --allowed-lora-paths.")
    pinned: bool = Field(False, description="Never evicted for room (--max-cpu-loras).")
    load_inplace: bool = Field(False, description="vLLM's: replace an adapter of the same name once the new one "
                               "passed every check (else 409).")


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM clients may send lora_int_id too

    lora_name: str


class LoRAAdapterCard(BaseModel):
    object: str = "lora_adapter"
    id: str
    parent: str
    path: str
    rank: int
    pinned: bool
    target_modules: list[str]
    digest: str
    created: int


def _enabled(request: Request) -> ServerState:
    state = rr.get_state(request)
    if not state.config.enable_lora_loading:
        raise LoRALoadingDisabled("loading LoRA adapters at run time is off; start the server with "
                                  "--enable-lora-loading (and --lora-dir or --allowed-lora-paths)")
    state.require_engine()
    return state


class LoRALoadingDisabled(InvalidRequestError):
    http_status = 403
    error_type = "lora_loading_disabled"


def _card(state: ServerState, a: dict[str, Any]) -> LoRAAdapterCard:
    return LoRAAdapterCard(id=a["name"], parent=state.model_id, path=a["path"], rank=a["rank"], pinned=a["pinned"],
                           target_modules=a["targets"], digest=a["digest"], created=a["created"])


@router.post("/v1/load_lora_adapter", response_model=LoRAAdapterCard, summary="Load a LoRA adapter while serving")
async def load_lora_adapter(body: LoadLoRARequest, request: Request):
    state = _enabled(request)
    name = check_name(body.lora_name)
    path = state.lora_paths.check(body.lora_path)
    engine = loaded_engine(state)
    await engine.load_lora(name, str(path), body.pinned, replace=body.load_inplace)
    return next(_card(state, a) for a in engine.adapters() if a["name"] == name)


@router.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter (409 while requests use it)")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> dict[str, Any]:
    state = _enabled(request)
    await loaded_engine(state).unload_lora(body.lora_name)
    return {"object": "lora_adapter", "id": body.lora_name, "deleted": True}


@router.get("/v1/lora_adapters", summary="The loaded LoRA adapters")
async def list_lora_adapters(request: Request) -> dict[str, Any]:
    state = rr.get_state(request)
    state.require_engine()
    return {"object": "list", "data": [_card(state, a) for a in loaded_engine(state).adapters()]}

"""GLM-4.5 (glm4_moe) and GLM-5 (glm_moe_dsa) checkpoints with their multi-token-prediction layer, and
transformers' own `MtpModel` as the reference for what that layer drafts.

transformers saves the models without their MTP layer; the layer is written here the way the hub's checkpoints
store it (`model.layers.{N}.*`, experts one by one, `shared_head.norm`), and `reference_mtp` loads it back through
`MtpModel.from_pretrained`, so the names are checked against transformers' own conversion too. transformers' GLM-5
config declares no MTP layer; `declare_mtp` gives it the one the real checkpoints have (a full-indexer MoE layer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.hf_reference import randomize_

# MtpModel's own names -> the checkpoint's, after "model.layers.{N}."
_RENAMES = (("layers.0.mtp_block.", ""), ("layers.0.post_norm.", "shared_head.norm."), ("layers.0.", ""))


def mtp_tensors(mtp: torch.nn.Module, num_layers: int, moe_intermediate: int) -> dict[str, torch.Tensor]:
    """`MtpModel` weights under the hub checkpoint's names (the shared embedding and head are the trunk's)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mtp.state_dict().items():
        if name.startswith(("embed_tokens.", "shared_head.")):
            continue
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        prefix = f"model.layers.{num_layers}."
        if name == "mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = w[:moe_intermediate].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = w[moe_intermediate:].clone()
        elif name == "mlp.experts.down_proj":
            for e, w in enumerate(t):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w.clone()
        else:
            out[prefix + name] = t.clone()
    return out


def add_mtp_layer(hf: torch.nn.Module, path: Path, seed: int = 5, std: float = 0.1,
                  copy_last_layer: bool = False) -> None:
    """Write a random MTP layer into the checkpoint `hf` saved at `path` (single file). `copy_last_layer`: the
    layer is the trunk's last decoder layer reading the trunk's hidden state alone (`eh_proj` = [0 | I]), a
    synthetic drafter whose guesses should beat chance by far."""
    from transformers.modeling_layers import MtpModel

    cfg = hf.config
    declare_mtp(hf)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2))
    mtp = MtpModel(hf, 1).to(torch.float32)
    randomize_(mtp, std=std, seed=seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p += 1.0
        if copy_last_layer:
            block = mtp.layers[0].mtp_block
            block.load_state_dict(hf.model.layers[-1].state_dict())
            h = cfg.hidden_size
            mtp.layers[0].eh_proj.weight.copy_(torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1))
            for norm in (mtp.layers[0].enorm, mtp.layers[0].hnorm, mtp.layers[0].post_norm):
                norm.weight.fill_(1.0)
            mtp.layers[0].post_norm.weight.copy_(hf.model.norm.weight)
    file = path / "model.safetensors"
    tensors = load_file(file)
    dtype = next(iter(tensors.values())).dtype
    tensors.update({k: v.to(dtype) for k, v in mtp_tensors(mtp, cfg.num_hidden_layers,
                                                              cfg.moe_intermediate_size).items()})
    save_file(tensors, file, metadata={"format": "pt"})


class _Hidden(torch.nn.Module):
    """A decoder layer that returns more than its hidden states (GLM-5's) as MtpLayer expects it: those alone."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def declare_mtp(hf: torch.nn.Module) -> None:
    """`hf`'s config says it has one MTP layer, of the kind the real checkpoints have."""
    cfg = hf.config
    cfg.num_mtp_layers = 1
    if getattr(cfg, "mlp_layer_types", None) is not None:
        cfg.mtp_mlp_layer_types = ["sparse"]
    if getattr(cfg, "layer_types", None) is not None:
        cfg.mtp_layer_types = cfg.layer_types[:1]


def reference_mtp(hf: torch.nn.Module) -> torch.nn.Module:
    """transformers' MTP layer of `hf`, loaded from the checkpoint it was loaded from."""
    from transformers.modeling_layers import MtpModel

    declare_mtp(hf)
    # the MTP layer's keys are found by the trunk's ignore patterns, written for GLM-4.5's 46 and 92 layers
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(hf, device_map={"": "cpu"}).to(hf.dtype).eval()
    mtp.config._experts_implementation = "eager"
    mtp.config._attn_implementation = "eager"  # GLM-5's indexer reads the mask, which sdpa's path leaves out
    layer = mtp.layers[0]
    layer.mtp_block = _Hidden(layer.mtp_block)
    if getattr(mtp.config, "layer_types", None) == ["indexed_attention"]:  # GLM-5: MtpModel knows no such mask
        from transformers.masking_utils import create_causal_mask

        def causal(layer_idx, inputs_embeds, mtp_cache, position_ids):
            return {"attention_mask": create_causal_mask(config=mtp.config, inputs_embeds=inputs_embeds,
                                                         attention_mask=None, cache=mtp_cache,
                                                         position_ids=position_ids, layer_idx=layer_idx)}

        mtp.create_masks_for_mtp_layer = causal
    return mtp


@torch.inference_mode()
def reference_drafts(hf: torch.nn.Module, mtp: torch.nn.Module, prompt: list[int], output: list[int]) -> list[int]:
    """transformers' MTP guesses, one after each output token: the k-th (from 1) is the layer's greedy token for
    output k+1, given the prompt and the first k outputs. Both the trunk and the MTP layer run with their caches,
    the prompt at once and then a token a step, as transformers decodes (GLM-5's indexer chooses keys differently
    when a whole sequence is recomputed)."""
    from transformers.cache_utils import DynamicCache, MtpCache

    ids = torch.tensor([prompt + output])
    cache, mtp_cache = DynamicCache(config=hf.config), MtpCache(config=hf.config.get_mtp_config())
    drafts: list[int] = []
    for start, stop in [(0, len(prompt)), *((t, t + 1) for t in range(len(prompt), len(prompt) + len(output) - 1))]:
        hidden = hf(ids[:, start:stop], past_key_values=cache, use_cache=True,
                    output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(start + 1, stop + 1)[None]
        out = mtp.forward_layer(0, hidden, positions, mtp_cache, input_ids=ids[:, start + 1 : stop + 1])
        drafts.append(int(mtp._project_to_logits(out[:, -1]).argmax(-1)))
    return drafts

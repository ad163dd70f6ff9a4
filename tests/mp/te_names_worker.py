"""torchrun worker: the weight map under Transformer-Engine parameter names, without TE.

A real Megatron model (local spec) is re-plumbed so that its parameters carry the names the TE
spec gives them: the input norm fused into `linear_qkv` / GDN's `in_proj`
(`…layer_norm_weight`), a dense MLP's pre-MLP norm fused into `linear_fc1`, and grouped-GEMM
experts (`experts.linear_fc1.weight{i}`). The same Parameter objects move, with their
tensor-parallel attributes. Then the HF checkpoint is loaded through the weight map and gathered
back out (the sync/export path); rank 0 reports whether every tensor round-trips bit for bit.

`torchrun --nproc-per-node 2 tests/mp/te_names_worker.py HF_DIR LAYOUTS OUT_JSON`
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.megatron.actor import Actor, init_parallel, unwrap  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.weights.hf_io import HFCheckpointReader  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_hf_layers, local_params, te_aliases  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from layouts_worker import LAYOUTS  # noqa: E402

from tests.mp.common import finish  # noqa: E402


def _move(src: torch.nn.Module, name: str, dst: torch.nn.Module, new: str) -> None:
    param = src._parameters.pop(name)
    dst.register_parameter(new, param)


def to_te_names(model: torch.nn.Module) -> None:
    for layer in unwrap(model).decoder.layers:
        attn = layer.self_attention
        _move(layer.input_layernorm, "weight", attn.linear_qkv if hasattr(attn, "linear_qkv") else attn.in_proj,
              "layer_norm_weight")
        mlp = layer.mlp
        if hasattr(mlp, "linear_fc1"):          # a dense MLP: TE fuses its norm into linear_fc1
            _move(layer.pre_mlp_layernorm, "weight", mlp.linear_fc1, "layer_norm_weight")
        experts = getattr(mlp, "experts", None)
        if experts is not None:                 # TEGroupedMLP: one module per fc, weight{i} per expert
            grouped = {fc: torch.nn.Module() for fc in ("linear_fc1", "linear_fc2")}
            for i, expert in enumerate(experts.local_experts):
                for fc, module in grouped.items():
                    _move(getattr(expert, fc), "weight", module, f"weight{i}")
            del experts.local_experts
            for fc, module in grouped.items():
                experts.add_module(fc, module)


def spec_maps(hf: dict) -> list[dict[str, str]]:
    """The `sharded_state_dict_keys_map` of every layer spec this model is built from."""
    recipe = build_model(hf, LAYOUTS["tp1"], torch.float32)
    spec = recipe.layer_spec
    if hf["architectures"][0] == "Qwen3NextForCausalLM":
        from megatron_rl.models.qwen3_next.layers import layer_types
        from megatron_rl.models.qwen3_next.provider import _local_layer_specs

        return [s.submodules.sharded_state_dict_keys_map for s in _local_layer_specs(recipe.config, layer_types(hf))]
    return [spec.submodules.sharded_state_dict_keys_map]


def main() -> None:
    hf_dir, layouts, out = sys.argv[1:4]
    hf = read_hf_config(hf_dir)
    adapter = weight_map(hf)
    reader = HFCheckpointReader(hf_dir)
    result = {}
    for name in layouts.split(","):
        init_parallel(LAYOUTS[name], seed=1)
        actor = Actor(build_model(hf, LAYOUTS[name], torch.float32), 1, None)
        to_te_names(actor.model)
        names = [n for n, _ in unwrap(actor.model).named_parameters()]
        load_hf_into_model(actor.model, hf_dir, adapter)
        got = {}
        for part in gather_hf_layers(actor.model, adapter):
            got.update(part)
        te_named = torch.tensor([sum(".layer_norm_weight" in n for n in names),
                                 sum(".experts.linear_fc" in n for n in names)])
        dist.all_reduce(te_named)
        if dist.get_rank() == 0:
            expected = reader.names()
            result[name] = {
                "te_norm_names": int(te_named[0]), "te_grouped_expert_names": int(te_named[1]),
                "local_names_seen": sorted({p.global_name.split(".", 3)[-1] for p in local_params(actor.model)})[:5],
                "missing": sorted(set(expected) - set(got)), "extra": sorted(set(got) - set(expected)),
                "mismatched": sorted(n for n in set(got) & set(expected) if not torch.equal(got[n], reader.get(n))),
            }
    reader.close()
    if dist.get_rank() == 0:
        result["alias_table"] = {"table": te_aliases(), "spec_maps": spec_maps(hf)}
    finish(result, out)


if __name__ == "__main__":
    main()

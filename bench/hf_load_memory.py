"""Peak memory of importing a HF checkpoint: ``python bench/hf_load_memory.py [--gib 1.0] [--keep DIR]``.

Writes a random fp32 ``glm4_moe``-shaped checkpoint of about ``--gib`` GiB (sharded, with an
index, generated tensor by tensor so the writer itself stays small), then loads it in a fresh
process the way ``load_hf_pretrained`` does (a deferred build, then each tensor streamed into its
parameter) and reports that process's peak RSS (``VmHWM``: :mod:`bench.peak_memory`) against the model's parameter bytes
in their storage dtype. The target is ``(peak - baseline) / model <= 1.25`` (baseline = RSS after
importing MindSpore and mindmoe): the model once, plus little more than one tensor.
Prints as its last line one JSON object ``{"case": "hf_load_memory", ..., "peak_growth_over_model"}``;
``mindmoe-bench --cases hf_load_memory`` runs it as an opt-in benchmark case. Not part of the test suite.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from safetensors.numpy import save_file  # noqa: E402

from mindmoe.bench.peak_memory import current_rss, own_peak_rss  # noqa: E402

# Shaped like a shrunken GLM-4.5: 1 dense layer then MoE layers with a shared expert, q/k/v bias,
# QK-norm, sigmoid router with correction bias. Experts hold most of the bytes, as in the real one.
BASE_CONFIG = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    partial_rotary_factor=0.5,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    attention_bias=True,
    use_qk_norm=True,
    moe_intermediate_size=1024,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_routed_experts=16,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    hidden_act="silu",
    torch_dtype="float32",
)
SHARD_BYTES = 200 * 2**20
#: Peak RSS growth of the import, as a multiple of the model's parameter bytes, that the bench accepts.
TARGET_GROWTH_OVER_MODEL = 1.25


def hf_tensor_shapes(config: dict) -> list:
    """``(HF name, shape)`` of a glm4_moe checkpoint, in HF's per-layer order."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes += [
            (prefix + "input_layernorm.weight", (hidden,)),
            (prefix + "post_attention_layernorm.weight", (hidden,)),
            (prefix + "self_attn.q_proj.weight", (q_out, hidden)),
            (prefix + "self_attn.q_proj.bias", (q_out,)),
            (prefix + "self_attn.k_proj.weight", (kv_out, hidden)),
            (prefix + "self_attn.k_proj.bias", (kv_out,)),
            (prefix + "self_attn.v_proj.weight", (kv_out, hidden)),
            (prefix + "self_attn.v_proj.bias", (kv_out,)),
            (prefix + "self_attn.o_proj.weight", (hidden, q_out)),
            (prefix + "self_attn.q_norm.weight", (head_dim,)),
            (prefix + "self_attn.k_norm.weight", (head_dim,)),
        ]
        if layer < config["first_k_dense_replace"]:
            shapes += swiglu(prefix + "mlp.", hidden, config["intermediate_size"])
            continue
        shapes += [
            (prefix + "mlp.gate.weight", (experts, hidden)),
            (prefix + "mlp.gate.e_score_correction_bias", (experts,)),
        ]
        for expert in range(experts):
            shapes += swiglu(f"{prefix}mlp.experts.{expert}.", hidden, width)
        shapes += swiglu(prefix + "mlp.shared_experts.", hidden, width * config["n_shared_experts"])
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (config["vocab_size"], hidden))]
    return shapes


def swiglu(prefix, hidden, width):
    return [
        (prefix + "gate_proj.weight", (width, hidden)),
        (prefix + "up_proj.weight", (width, hidden)),
        (prefix + "down_proj.weight", (hidden, width)),
    ]


def write_checkpoint(directory: Path, target_bytes: int) -> int:
    """A random checkpoint of about ``target_bytes``; returns the weight bytes written."""
    config = dict(BASE_CONFIG, num_hidden_layers=1)
    while sum(4 * int(np.prod(s)) for _, s in hf_tensor_shapes(config)) < target_bytes:
        config["num_hidden_layers"] += 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)
    shards, pending, pending_bytes, total = [], {}, 0, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(pending, str(directory / name), metadata={"format": "pt"})
        shards.append((name, list(pending)))

    for name, shape in hf_tensor_shapes(config):
        array = rng.standard_normal(size=shape, dtype=np.float32) * np.float32(0.02)
        if pending and pending_bytes + array.nbytes > SHARD_BYTES:
            flush()
            pending, pending_bytes = {}, 0
        pending[name] = array
        pending_bytes += array.nbytes
        total += array.nbytes
    flush()
    weight_map = {tensor: name for name, tensors in shards for tensor in tensors}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def load_in_this_process(directory: str):
    import mindspore  # noqa: F401  (the baseline includes the framework)

    from mindmoe.model.deferred_init import checkpoint_weights
    from mindmoe.model.hf import load_hf_weights, plan_hf_weights, read_pretrained_config
    from mindmoe.model.moe_config import MoEConfig
    from mindmoe.model.transformer import MoETransformer

    baseline = current_rss()
    # The steps of load_hf_pretrained, timed and measured one by one.
    started = time.perf_counter()
    imported = read_pretrained_config(directory)
    plan = plan_hf_weights(directory, imported)
    with checkpoint_weights():
        model = MoETransformer(imported.model_config, moe=MoEConfig(dispatch="dropless"))
    built = time.perf_counter()
    peak_after_build = own_peak_rss()
    load_hf_weights(model, plan)
    loaded = time.perf_counter()
    param_bytes = sum(int(np.prod(p.shape)) * p.itemsize for p in model.get_parameters())  # storage dtype
    print(
        json.dumps(
            {
                "baseline_rss": baseline,
                "peak_rss_after_build": peak_after_build,
                "peak_rss": own_peak_rss(),
                "final_rss": current_rss(),
                "param_bytes": param_bytes,
                "build_seconds": round(built - started, 2),
                "stream_seconds": round(loaded - built, 2),
                "layers": imported.model_config.num_layers,
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size to generate")
    parser.add_argument("--keep", help="write the checkpoint here and keep it (default: a temporary dir)")
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the measuring child process
    args = parser.parse_args()
    if args.load:
        load_in_this_process(args.load)
        return
    with tempfile.TemporaryDirectory(prefix="hf_load_memory_") as tmp:
        directory = Path(args.keep or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        file_bytes = write_checkpoint(directory, int(args.gib * 2**30))
        child = subprocess.run(
            [sys.executable, __file__, "--load", str(directory)], capture_output=True, text=True, check=False
        )
        if child.returncode:
            sys.exit(f"loading failed:\n{child.stderr[-4000:]}")
        measured = json.loads(child.stdout.strip().splitlines()[-1])
    growth = measured["peak_rss"] - measured["baseline_rss"]
    gib = 2**30
    print(
        json.dumps(
            {
                "case": "hf_load_memory",
                "file_gib": round(file_bytes / gib, 3),
                "model_param_gib": round(measured["param_bytes"] / gib, 3),
                "baseline_rss_gib": round(measured["baseline_rss"] / gib, 3),
                "peak_rss_gib": round(measured["peak_rss"] / gib, 3),
                "peak_growth_gib": round(growth / gib, 3),
                "budget_met": growth <= TARGET_GROWTH_OVER_MODEL * measured["param_bytes"],
                "peak_growth_while_building_gib": round(
                    (measured["peak_rss_after_build"] - measured["baseline_rss"]) / gib, 3
                ),
                "final_rss_gib": round(measured["final_rss"] / gib, 3),
                "build_seconds": measured["build_seconds"],
                "stream_seconds": measured["stream_seconds"],
                "layers": measured["layers"],
                "peak_growth_over_model": round(growth / measured["param_bytes"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()

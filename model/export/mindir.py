"""Write the prefill and decode graphs of a model as MindIR with dynamic batch and sequence axes.

    graphs = export_mindir(model, out_dir, dtype="fp32")   # {"prefill": {...}, "decode": {...}}

Each entry names the graph file, the external weight files (MindSpore writes the weights of a
graph beside it, as ``<name>_graph.mindir`` + ``<name>_variables/data_*``, once they pass 1 GiB)
and every input and output: name, shape (a string for a dynamic axis), dtype. :func:`cache_layout` states
what ``kv_cache`` holds (GQA: per-head keys and values; MLA: the latent and the shared RoPE key, and with DeepSeek
Sparse Attention the indexer's key, :mod:`model.export.mla_serving`) for the manifest's ``cache`` entry.
"""

from pathlib import Path

import mindspore as ms
from mindspore import Tensor

from mindmoe.model.export.lock_state import lock_state_width
from mindmoe.model.export.mla_serving import caches_indexer_keys, mla_cache_row, mla_cache_width, serving_dsa_stage
from mindmoe.model.export.serving import PrefillGraph, cache_length_axis, carries_lock_state, decode_graph

EXPORT_DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
GRAPH_NAMES = ("prefill", "decode")
# Axis names of the manifest: -1 in a converter's shape, any size at run time.
BATCH, PROMPT, CAPACITY = "batch", "prompt_len", "cache_len"


def keeps_fp32(name: str) -> bool:
    """RMSNorm weights and the router stay fp32: both are computed in fp32 whatever the compute dtype."""
    return name.endswith("norm.weight") or ".mlp.router." in name


def cast_parameters(model, dtype: str) -> None:
    """Cast the weights to the export ``dtype`` in place (before any graph is compiled)."""
    target = EXPORT_DTYPES[dtype]
    for param in model.get_parameters():
        if not keeps_fp32(param.name) and param.dtype != target:
            param.set_dtype(target)


def cache_layout(cfg, dtype: str = "fp32", dsa_stage: str = "sparse") -> dict:
    """What ``kv_cache`` holds, for the manifest: its kind, axes (``shape``, decode's capacity axis named
    ``cache_len``), the axis that counts positions, and the values cached per token (per layer and in all);
    MLA also lists the parts of a row (``row``: name, first value, values, what)."""
    layers = cfg.num_layers
    if cfg.attention_type == "mla":
        per_layer = mla_cache_width(cfg, dsa_stage)
        layout = mla_layout(cfg, dsa_stage)
    else:
        kv_heads, head_dim = cfg.num_kv_heads, cfg.resolved_head_dim
        per_layer = 2 * kv_heads * head_dim
        layout = {
            "kind": "gqa_kv",
            "shape": [layers, 2, BATCH, kv_heads, CAPACITY, head_dim],
            "description": "per layer: keys then values of every key/value head, after QK-norm and RoPE",
        }
    return dict(
        layout,
        dtype=DTYPE_NAMES[dtype],
        length_axis=cache_length_axis(cfg),
        values_per_token_per_layer=per_layer,
        values_per_token=layers * per_layer,
    )


def mla_layout(cfg, dsa_stage: str = "sparse") -> dict:
    """The MLA part of :func:`cache_layout`: ``row`` lists each part of a layer's row (name, index of its first
    value, number of values, what it is), and the description states the same in words."""
    row, start = [], 0
    for name, values, what in mla_cache_row(cfg, dsa_stage):
        row.append({"name": name, "start": start, "values": values, "description": what})
        start += values
    parts = ", then ".join(
        f"{part['name']} (values {part['start']}..{part['start'] + part['values'] - 1}, {part['description']})"
        for part in row
    )
    description = (
        f"per layer and token, shared by all heads: {parts}; decode absorbs kv_b_proj into the query and output"
    )
    kind = "mla_latent"
    if caches_indexer_keys(cfg, dsa_stage):
        kind = "mla_latent_dsa"
        description += (
            f"; each decode step attends to the min(index_topk={cfg.dsa.index_topk}, position + 1) slots whose "
            "index_k its indexer query scores best"
        )
    return {"kind": kind, "shape": [cfg.num_layers, BATCH, CAPACITY, start], "description": description, "row": row}


def graph_signatures(cfg, dtype: str, lock_state: bool = False, dsa_stage: str = "sparse") -> dict:
    """Inputs and outputs of both graphs, in call order, for the manifest; ``lock_state``: the decode graph
    carries the expert-lock state (:func:`model.export.serving.carries_lock_state`)."""
    layout = cache_layout(cfg, dtype, dsa_stage)

    def cache(length: str) -> dict:
        shape = list(layout["shape"])
        shape[layout["length_axis"]] = length
        return {
            "name": "kv_cache",
            "shape": shape,
            "dtype": layout["dtype"],
            "description": f"{layout['kind']} cache ({layout['description']}); decode takes the prefill "
            "cache zero-padded on its length axis to a fixed cache_len",
        }

    def logits(what: str) -> dict:
        return {"name": "logits", "shape": [BATCH, cfg.vocab_size], "dtype": "float32", "description": what}

    def lock() -> list:
        if not lock_state:
            return []
        return [
            {
                "name": "lock_state",
                "shape": [cfg.num_moe_layers, BATCH, lock_state_width(cfg.top_k)],
                "dtype": "int32",
                "description": "expert-lock state per MoE layer (model/export/lock_state.py)",
            }
        ]

    prefill_inputs = [
        {
            "name": "input_ids",
            "shape": [BATCH, PROMPT],
            "dtype": "int32",
            "description": "prompt token ids; every prompt of a batch has the same length",
        }
    ]
    decode_inputs = [
        {
            "name": "input_ids",
            "shape": [BATCH, 1],
            "dtype": "int32",
            "description": "the latest token of each sequence",
        },
        cache(CAPACITY),
        {
            "name": "position",
            "shape": [BATCH],
            "dtype": "int32",
            "description": "position of input_ids = tokens already in the cache; < cache_len",
        },
    ] + lock()
    return {
        "prefill": {
            "inputs": prefill_inputs,
            "outputs": [logits("next-token logits after the last prompt position"), cache(PROMPT)] + lock(),
        },
        "decode": {"inputs": decode_inputs, "outputs": [logits("next-token logits"), cache(CAPACITY)] + lock()},
    }


def _placeholder(entry: dict, dtype_map: dict) -> Tensor:
    shape = [dim if isinstance(dim, int) else None for dim in entry["shape"]]
    return Tensor(shape=shape, dtype=dtype_map[entry["dtype"]])


def export_mindir(model, out_dir, dtype: str = "fp32") -> dict:
    """Write ``prefill`` and ``decode`` MindIR into ``out_dir``; ``model`` is cast to ``dtype`` in place."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export.dtype={dtype!r}: must be one of {tuple(EXPORT_DTYPES)}")
    out = Path(out_dir)
    stale = sorted(path.name for path in out.iterdir() if path.name.startswith(GRAPH_NAMES)) if out.is_dir() else []
    if stale:
        raise ValueError(
            f"{out} already holds exported graphs ({', '.join(stale[:3])}); export into an empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    cast_parameters(model, dtype)
    signatures = graph_signatures(model.config, dtype, carries_lock_state(model), serving_dsa_stage(model))
    dtype_map = {"int32": ms.int32, "float32": ms.float32, DTYPE_NAMES[dtype]: EXPORT_DTYPES[dtype]}
    cells = {"prefill": PrefillGraph(model), "decode": decode_graph(model)}
    graphs = {}
    for name in GRAPH_NAMES:
        placeholders = [_placeholder(entry, dtype_map) for entry in signatures[name]["inputs"]]
        ms.export(cells[name], *placeholders, file_name=str(out / name), file_format="MINDIR")
        graphs[name] = dict(_written_files(out, name), **signatures[name])
        for entry, graph_name in zip(graphs[name]["inputs"], mindir_input_names(out / graphs[name]["file"])):
            entry["mindir_name"] = graph_name
    return graphs


def mindir_input_names(path) -> list:
    """The input names stored in a MindIR graph file (``<graph id>:<argument>``; converters address inputs by them)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    return [graph_input.name for graph_input in model.graph.input]


def _written_files(out: Path, name: str) -> dict:
    single = out / f"{name}.mindir"
    if single.is_file():
        return {"file": single.name, "weight_files": []}
    graph = out / f"{name}_graph.mindir"
    if not graph.is_file():
        raise RuntimeError(f"mindspore.export wrote neither {single} nor {graph}")
    weights = sorted(str(path.relative_to(out)) for path in (out / f"{name}_variables").iterdir())
    return {"file": graph.name, "weight_files": weights}

"""``CONVERT.md`` and the MindSpore Lite converter configs written beside exported graphs.

Ascend compiles every input shape ahead of time, so "dynamic" means a list of gears (profiles,
at most 100): prefill gets every (batch size, prompt length) pair of ``export.ascend_batch_sizes`` x
``export.ascend_prompt_lengths`` as ND dynamic dimensions; decode has a fixed cache capacity
(``export.ascend_cache_len``), so only its batch size varies. The text names the documentation versions
the commands were taken from; nothing here can run without an Ascend host.
"""

from pathlib import Path

from mindmoe.train.export.config import ExportConfig

CONVERT_FILE = "CONVERT.md"
PREFILL_CONFIG = "prefill_ascend.ini"
DECODE_CONFIG = "decode_ascend.ini"
# The converter's precision default is enforce_fp16; exported dtypes are kept as they are.
PRECISION = "enforce_origin"
DOCS_CHECKED = (
    "MindSpore Lite cloud-side inference, 'Ascend Conversion Tool Description' (converter_tool_ascend): "
    "source of r2.7.0rc1 (ascend_context / acl_build_options tables, 'Dynamic Shape Configuration'), "
    "pages r2.9.0 and r2.10.0 (same ascend_context table)",
    "MindSpore 2.9.0 `mindspore.export` docstring (installed package): AIR is deprecated in favour of "
    "MindIR + MindSpore Lite",
    "CANN ATC tool guide, parameter overview (commercial 9.0.0): --framework=1 is MindSpore (AIR); "
    "MindSpore-framework inputs are FP32/FP16/UINT8",
    "CANN 5.0.4 AscendCL guide: ND dynamic dimensions support N <= 4 axes",
)


def _dims(entry: dict, sizes: dict) -> str:
    return ",".join(str(sizes.get(dim, -1) if isinstance(dim, str) else dim) for dim in entry["shape"])


def prefill_config(graph: dict, batch_sizes, lengths) -> str:
    (input_ids,) = graph["inputs"]
    gears = ";".join(f"{batch},{length}" for batch in batch_sizes for length in lengths)
    return (
        f"[ascend_context]\nprecision_mode={PRECISION}\n\n"
        "[acl_build_options]\n"
        'input_format="ND"\n'
        f'input_shape="{input_ids["mindir_name"]}:{_dims(input_ids, {})}"\n'
        f'ge.dynamicDims="{gears}"\n'
    )


def decode_config(graph: dict, batch_sizes, cache_len: int) -> str:
    shapes = ";".join(f"{entry['mindir_name']}:[{_dims(entry, {'cache_len': cache_len})}]" for entry in graph["inputs"])
    profiles = ",".join(f"[{batch}]" for batch in batch_sizes)
    return (
        f"[ascend_context]\nprecision_mode={PRECISION}\n"
        f"input_shape={shapes}\n"
        f"dynamic_dims={';'.join([profiles] * len(graph['inputs']))}\n"
    )


def conversion_guide(manifest: dict, batch_sizes: list, lengths: list, cache_len: int) -> str:
    graphs = manifest["graphs"]
    prefill, decode = graphs["prefill"]["file"], graphs["decode"]["file"]
    weights = [name for graph in graphs.values() for name in graph["weight_files"]]
    lines = [
        "# Converting these graphs for Ascend",
        "",
        f"`{prefill}` and `{decode}` were exported by mindmoe {manifest['mindmoe_version']} with MindSpore "
        f"{manifest['mindspore_version']} ({manifest['dtype']}); `manifest.json` lists every input and output. "
        + (f"Their weights are in {', '.join(weights)} beside them (keep the directory layout). " if weights else "")
        + "Both run as they are with `mindspore.load` + `nn.GraphCell` on CPU (`mindmoe-generate`). "
        "Nothing below was run on this machine (it has no Ascend device): the commands follow the documentation "
        "listed at the end.",
        "",
    ]
    lines += _lite_section(prefill, decode, batch_sizes, lengths, cache_len)
    lines += _atc_section(batch_sizes, lengths)
    lines += ["## Documentation checked", ""] + [f"- {entry}" for entry in DOCS_CHECKED]
    return "\n".join(lines) + "\n"


def _lite_section(prefill: str, decode: str, batch_sizes: list, lengths: list, cache_len: int) -> list:
    return [
        "## 1. MindSpore Lite converter (MindIR for Ascend)",
        "",
        "On an Ascend host with CANN and the MindSpore Lite cloud-side inference package of the same MindSpore "
        "version (`converter_lite` is in its `tools/converter/converter/`):",
        "",
        "```bash",
        f"converter_lite --fmk=MINDIR --modelFile={prefill} --outputFile=prefill_ascend "
        f"--optimize=ascend_oriented --configFile={PREFILL_CONFIG}",
        f"converter_lite --fmk=MINDIR --modelFile={decode} --outputFile=decode_ascend "
        f"--optimize=ascend_oriented --configFile={DECODE_CONFIG}",
        "```",
        "",
        f"`{PREFILL_CONFIG}` compiles `input_ids [batch, prompt_len]` as ND dynamic dimensions with one gear per "
        f"(batch, prompt_len) pair of batch sizes {batch_sizes} and prompt lengths {lengths}. `{DECODE_CONFIG}` "
        f"compiles a dynamic batch ({batch_sizes}) with the KV cache fixed at cache_len={cache_len} slots. Edit "
        "the gears (at most 100) or re-export with `export.ascend_batch_sizes`, `export.ascend_prompt_lengths`, "
        "`export.ascend_cache_len`. Inputs are addressed by the names stored in the graphs (`mindir_name` in "
        f"`manifest.json`). `precision_mode={PRECISION}` keeps the exported dtype (the converter defaults to "
        "enforce_fp16).",
        "",
        "At run time, resize the inputs to a gear (`Model.resize`), pad prompts of a batch to the chosen "
        "prompt_len only if the padding is part of the text (there is no attention mask), zero-pad the prefill "
        "`kv_cache` on its length axis to cache_len, then call decode once per token with `position` = tokens "
        "already cached, feeding back `kv_cache` (and `lock_state`).",
        "",
    ]


def _atc_section(batch_sizes: list, lengths: list) -> list:
    return [
        "## 2. OM files via ATC",
        "",
        "ATC does not read MindIR. It reads AIR (`--framework=1`), which MindSpore writes only on an Ascend host "
        "and marks as deprecated in 2.9. On such a host, export the same graph cells as AIR, then compile:",
        "",
        "```python",
        "import mindspore as ms",
        "from mindspore import Tensor",
        "from mindmoe.model.export.serving import PrefillGraph",
        "# model: the MoETransformer with the checkpoint's weights and moe.dispatch=dropless",
        "ms.export(PrefillGraph(model), Tensor(shape=[None, None], dtype=ms.int32), file_name='prefill', "
        "file_format='AIR')",
        "```",
        "",
        "```bash",
        "atc --model=prefill.air --framework=1 --output=prefill --soc_version=<your SoC, e.g. Ascend910B1> "
        '--input_format=ND --input_shape="input_ids:-1,-1" '
        f'--dynamic_dims="{";".join(f"{batch},{length}" for batch in batch_sizes for length in lengths)}"',
        "```",
        "",
        "Limits stated by that documentation: MindSpore-framework inputs are listed as FP32/FP16/UINT8 (input_ids "
        "are int32), and ND dynamic dimensions cover at most 4 axes, while the decode graph's `kv_cache` has 6 "
        "(4 for an MLA model's latent cache: `cache` in `manifest.json`); for decode, fix every shape (one OM per "
        "batch size) if ATC rejects the dynamic form.",
        "",
    ]


def write_conversion_files(out: Path, manifest: dict, export_cfg: ExportConfig) -> None:
    max_positions = manifest["model_config"]["max_position_embeddings"]
    cache_len = export_cfg.ascend_cache_len or max_positions
    batch_sizes = sorted(set(export_cfg.ascend_batch_sizes))
    lengths = sorted({min(length, max_positions) for length in export_cfg.ascend_prompt_lengths})
    graphs = manifest["graphs"]
    (out / PREFILL_CONFIG).write_text(prefill_config(graphs["prefill"], batch_sizes, lengths), encoding="utf-8")
    (out / DECODE_CONFIG).write_text(decode_config(graphs["decode"], batch_sizes, cache_len), encoding="utf-8")
    (out / CONVERT_FILE).write_text(conversion_guide(manifest, batch_sizes, lengths, cache_len), encoding="utf-8")

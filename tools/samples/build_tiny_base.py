"""Rebuild ``data/samples/tiny_base/``: the small pretrained base that ``recipe=lora_business`` fine-tunes.

    python -m tools.samples.build_tiny_base             # ~400 steps of pretraining on CPU, then export
    python -m tools.samples.build_tiny_base --out DIR --steps 400

It pretrains a small GLM-4.5-style MoE (hidden 128, 4 layers with the first dense, 4 routed experts
+ 1 shared, sigmoid router with aux-loss-free bias balancing, dropless dispatch, tied embeddings,
4k sentencepiece vocabulary trained on the bundled corpus) with
``recipe=pretrain_tiny`` on ``corpus_train.jsonl``, exports the last checkpoint as a HF ``glm4_moe``
directory (``mindmoe.model.hf.export_hf``) with the sentencepiece model as ``tokenizer.model``, and stores
the weights as float16 to keep the sample small (mindmoe converts them to float32 when loading).
Needs mindmoe installed (``pip install -e .``).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
# A glm4_moe-shaped model (sigmoid router with a correction bias, as HF glm4_moe has) trained without
# token dropping, so the exported directory computes in transformers what was trained here.
MODEL_OVERRIDES = [
    "model.hidden_size=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=384",
    "model.num_experts=4",
    "model.moe_intermediate_size=96",
    "model.tie_word_embeddings=true",
    "model.score_func=sigmoid",
    "model.expert_bias=true",
    "moe.bias_update_rate=0.002",
    "moe.aux_loss=seq",
    "moe.aux_loss_coeff=0.0001",
    "moe.dispatch=dropless",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "data" / "samples" / "tiny_base")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the pretraining run here")
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="tiny_base_run."))
    command = [
        sys.executable,
        "-m",
        "mindmoe.train.cli",
        "recipe=pretrain_tiny",
        f"train.max_steps={args.steps}",
        f"train.save_every={args.steps}",
        "train.eval_every=0",
        "train.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ] + MODEL_OVERRIDES
    subprocess.run(command, check=True, cwd=REPO)
    export(run_dir / "checkpoints" / f"step_{args.steps:06d}", args.out)
    print(f"tiny base written to {args.out}")


def export(checkpoint: Path, out: Path) -> None:
    from mindmoe.data.tokenizer import load_tokenizer
    from mindmoe.model.hf import export_hf
    from mindmoe.train.checkpoints.tokenizer import carried_tokenizer

    tokenizer = load_tokenizer(carried_tokenizer(checkpoint))
    export_hf(checkpoint, out_dir=out)
    shutil.copyfile(tokenizer.path, out / "tokenizer.model")
    for path in out.glob("*.safetensors"):
        tensors = {name: value.astype(np.float16) for name, value in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(
        torch_dtype="float16",
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

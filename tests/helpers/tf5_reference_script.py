"""Runs inside the transformers-5 reference venv (``tf5_reference.py``), never in the test session.

``python tf5_reference_script.py spec.json``; spec ``mode``:

* ``build``: ``AutoModelForCausalLM.from_config(config)`` in fp32 with eager attention, O(1) random weights from
  ``seed`` (transformers' own init is too small for logits to tell implementations apart), ``save_pretrained`` to
  ``save_dir``;
* ``reload``: ``AutoModelForCausalLM.from_pretrained(load_dir)`` in fp32 with eager attention;
* ``config``: only ``AutoConfig.for_model(**config).to_dict()`` (the class's defaults), into ``result.json``.

``build`` and ``reload`` write, next to ``spec.json``: ``logits.npy`` (all positions of ``ids``),
``state.safetensors`` (the model's ``state_dict``) and ``result.json`` (paths, ``config.to_dict()``,
transformers' version). With ``capture`` (module-name suffixes, e.g. ``["self_attn.indexer"]``) also
``captured.npz``: the tensor arguments each such module was called with, ``{module}.arg{i}`` (``arg{i}.{j}`` for
the tensors of a tuple argument).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def randomize(model, seed: int) -> None:
    """Routers strong enough that routing is decisive; correction biases in [0, 0.3) (non-negative, so that
    masking unselected groups with 0.0 never picks a masked expert); norms near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("e_score_correction_bias"):
                value = 0.3 * torch.rand(tensor.shape, generator=generator)
            elif "norm" in name:
                value = 1.0 + 0.2 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = noise
            elif name.endswith("gate.weight"):
                value = 0.5 * noise
            else:
                value = 0.2 * noise
            tensor.copy_(value)


def capture_inputs(model, suffixes) -> dict:
    """Forward pre-hooks on the modules whose names end with one of ``suffixes``; the returned dict fills with their
    tensor arguments as numpy arrays while the model runs."""
    captured = {}

    def hook(name):
        def record(_module, args):
            for i, arg in enumerate(args):
                tensors = enumerate(arg) if isinstance(arg, tuple) else [(None, arg)]
                parts = [(f"arg{i}" if j is None else f"arg{i}.{j}", a) for j, a in tensors]
                for key, value in parts:
                    if isinstance(value, torch.Tensor):
                        captured[f"{name}.{key}"] = value.detach().float().numpy()

        return record

    for name, module in model.named_modules():
        if any(name.endswith(suffix) for suffix in suffixes):
            module.register_forward_pre_hook(hook(name))
    return captured


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    work = Path(spec_file).parent
    torch.manual_seed(spec.get("seed", 0))
    if spec["mode"] == "config":
        values = dict(spec["config"])
        config = AutoConfig.for_model(values.pop("model_type"), **values).to_dict()
        (work / "result.json").write_text(json.dumps(dict(config=config), default=str), encoding="utf-8")
        return
    if spec["mode"] == "build":
        values = dict(spec["config"])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        randomize(model, spec["seed"])
        model.eval()
        model.save_pretrained(spec["save_dir"])
    else:
        model = AutoModelForCausalLM.from_pretrained(
            spec["load_dir"], dtype=torch.float32, attn_implementation="eager"
        ).eval()
    ids = torch.tensor(spec["ids"], dtype=torch.long)
    captured = capture_inputs(model, spec.get("capture") or ())
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().numpy()
    np.save(work / "logits.npy", logits)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(work / "state.safetensors"))
    result = dict(
        logits=str(work / "logits.npy"),
        state=str(work / "state.safetensors"),
        config=model.config.to_dict(),
        transformers=transformers.__version__,
        model_class=type(model).__name__,
    )
    if captured:
        np.savez(work / "captured.npz", **captured)
        result["captured"] = str(work / "captured.npz")
    (work / "result.json").write_text(json.dumps(result, default=str), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])

"""Reference runner: generate tokens from an export directory with ``mindspore.load`` + ``nn.GraphCell``.

    exported = ExportedModel("/path/to/export")             # reads manifest.json, loads both graphs
    new_ids = exported.generate(prompt_ids, max_new_tokens=32)                    # greedy
    new_ids = exported.generate(prompt_ids, 32, temperature=0.8, top_k=50, top_p=0.95, seed=1)

It shows serving code what the graphs expect: one prefill call for the prompts, the returned cache
zero-padded to a fixed capacity (prompt length + new tokens here) along the axis the manifest's
``cache.length_axis`` names (GQA's per-head keys/values or MLA's latent; the runner needs neither's
layout beyond that), then one decode call per new token feeding back the cache (and lock state) the
previous call returned. Sampling
is done in NumPy from the fp32 logits: temperature, then top-k, then top-p (the smallest set of
most likely tokens whose probability reaches ``top_p``; the most likely token always stays).
"""

import json
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

MANIFEST_FILE = "manifest.json"


def sample_next(
    logits_BV: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator
) -> np.ndarray:
    """Next token per row ``[B]`` int32: argmax when ``temperature == 0``, else a draw from the filtered softmax."""
    if temperature == 0:
        return logits_BV.argmax(-1).astype(np.int32)
    scaled_BV = logits_BV.astype(np.float64) / temperature
    if 0 < top_k < scaled_BV.shape[-1]:
        kth_B1 = np.sort(scaled_BV, -1)[:, -top_k][:, None]
        scaled_BV = np.where(scaled_BV < kth_B1, -np.inf, scaled_BV)
    probs_BV = np.exp(scaled_BV - scaled_BV.max(-1, keepdims=True))
    probs_BV /= probs_BV.sum(-1, keepdims=True)
    if top_p < 1.0:
        order_BV = np.argsort(-probs_BV, -1, kind="stable")
        sorted_BV = np.take_along_axis(probs_BV, order_BV, -1)
        # Keep a token if the mass before it is still short of top_p (so the first is always kept).
        keep_sorted_BV = (np.cumsum(sorted_BV, -1) - sorted_BV) < top_p
        keep_BV = np.zeros_like(keep_sorted_BV)
        np.put_along_axis(keep_BV, order_BV, keep_sorted_BV, -1)
        probs_BV = np.where(keep_BV, probs_BV, 0.0)
        probs_BV /= probs_BV.sum(-1, keepdims=True)
    return np.array([rng.choice(probs_BV.shape[-1], p=row) for row in probs_BV], np.int32)


def length_problem(
    prompt_len: int, max_new_tokens: int, max_positions: int, new_tokens_key: str = "max_new_tokens"
) -> str:
    """Why ``prompt_len`` prompt tokens plus ``max_new_tokens`` cannot be generated within ``max_positions``
    (the model's ``max_position_embeddings``), or "" if they can. ``new_tokens_key``: how the caller names
    ``max_new_tokens`` (``--max-new-tokens`` on the command line)."""
    if max_new_tokens < 1:
        return f"{new_tokens_key}={max_new_tokens} must be >= 1"
    if prompt_len >= max_positions:
        return (
            f"the prompt is {prompt_len} tokens long, but the model's max_position_embeddings={max_positions} "
            f"leaves no room for a new token: shorten the prompt to at most {max_positions - 1} tokens"
        )
    if prompt_len + max_new_tokens > max_positions:
        return (
            f"{new_tokens_key}={max_new_tokens}: the prompt is {prompt_len} tokens long and the model's "
            f"max_position_embeddings={max_positions}, so at most {max_positions - prompt_len} new tokens fit"
        )
    return ""


class ExportedModel:
    """The two graphs of an export directory, with the manifest that describes them."""

    def __init__(self, export_dir):
        self.directory = Path(export_dir)
        manifest_path = self.directory / MANIFEST_FILE
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{self.directory}: no {MANIFEST_FILE} (expected a directory written by "
                "mindmoe-export export.format=mindir)"
            )
        self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        graphs = self.manifest["graphs"]
        self.prefill = nn.GraphCell(ms.load(str(self.directory / graphs["prefill"]["file"])))
        self.decode = nn.GraphCell(ms.load(str(self.directory / graphs["decode"]["file"])))
        self.carries_lock_state = any(entry["name"] == "lock_state" for entry in graphs["decode"]["inputs"])
        # Manifests written before the cache layout was recorded hold GQA caches, positions on axis 4.
        self.cache_length_axis = int(self.manifest.get("cache", {}).get("length_axis", 4))

    @property
    def max_positions(self) -> int:
        """Prompt plus new tokens of one sequence fit in this many positions (``max_position_embeddings``)."""
        return int(self.manifest["model_config"]["max_position_embeddings"])

    def generate(
        self,
        prompt_ids_BS,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_id: int = -1,
    ) -> np.ndarray:
        """New tokens ``[B, N]`` int32 after the prompts, N <= ``max_new_tokens``: generation stops early once
        every row has emitted ``eos_id`` (>= 0), and a finished row repeats it."""
        prompt_ids_BS = np.asarray(prompt_ids_BS, np.int32)
        if prompt_ids_BS.ndim != 2 or prompt_ids_BS.shape[1] < 1:
            raise ValueError(f"prompt ids must be [batch, length >= 1], got shape {list(prompt_ids_BS.shape)}")
        problem = length_problem(prompt_ids_BS.shape[1], max_new_tokens, self.max_positions)
        if problem:
            raise ValueError(problem)
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"temperature={temperature} (>= 0), top_k={top_k} (>= 0), top_p={top_p} (in (0, 1])")
        rng = np.random.default_rng(seed)
        batch, position = prompt_ids_BS.shape
        outputs = list(self.prefill(Tensor(prompt_ids_BS)))
        # The decode graph writes token t's keys/values into slot t of a cache of fixed capacity.
        kv_cache = outputs[1].asnumpy()
        padding = [(0, 0)] * kv_cache.ndim
        padding[self.cache_length_axis] = (0, max(max_new_tokens - 1, 0))
        outputs[1] = Tensor(np.pad(kv_cache, padding))
        finished_B = np.zeros(batch, bool)
        new_tokens = []
        for step in range(max_new_tokens):
            next_B = sample_next(outputs[0].asnumpy(), temperature, top_k, top_p, rng)
            if eos_id >= 0:
                next_B = np.where(finished_B, eos_id, next_B)
                finished_B |= next_B == eos_id
            new_tokens.append(next_B)
            if step == max_new_tokens - 1 or finished_B.all():
                break
            inputs = [Tensor(next_B[:, None]), outputs[1], Tensor(np.full(batch, position, np.int32))]
            if self.carries_lock_state:
                inputs.append(outputs[2])
            outputs = self.decode(*inputs)
            position += 1
        return np.stack(new_tokens, 1)

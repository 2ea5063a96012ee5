"""HF import into a model built for one expert-parallel rank: only that rank's expert rows are read."""

import numpy as np
import torch
from transformers import Glm4MoeForCausalLM

from mindmoe.model.hf import load_hf_pretrained
from mindmoe.model.moe.token_dispatcher import ExpertPlacement
from tests.helpers.hf_models import glm4_config, randomize_hf, save_hf


class SecondHalfOfTheExperts(ExpertPlacement):
    """The placement of rank 1 of 2 without its collectives: enough to check which rows a rank loads."""

    def held_experts(self, num_experts: int) -> range:
        return range(num_experts // 2, num_experts)


def test_a_rank_holding_half_the_experts_gets_exactly_its_rows_of_the_hf_tensors(tmp_path):
    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(glm4_config()).eval()
    randomize_hf(hf, seed=3)
    directory = save_hf(hf, tmp_path / "hf")
    state = {name: tensor.float().numpy() for name, tensor in hf.state_dict().items()}

    model_cfg, model, _ = load_hf_pretrained(directory, expert_dispatcher=SecondHalfOfTheExperts())
    params = {param.name: param.asnumpy() for param in model.get_parameters()}
    half = model_cfg.num_experts // 2
    for layer in range(model_cfg.first_k_dense, model_cfg.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            held = params[f"layers.{layer}.mlp.experts.{proj}"]
            assert held.shape[0] == half
            for row in range(half):
                expected = state[f"model.layers.{layer}.mlp.experts.{half + row}.{proj}.weight"]
                np.testing.assert_array_equal(held[row], expected)
    np.testing.assert_array_equal(params["embed_tokens.weight"], state["model.embed_tokens.weight"])

"""Every trained parameter of the model is read through its seam (model/weights.py), so ZeRO-2/3
(train/parallel/fsdp.py) shards it; the few that are not are named here, and ZeRO shards them as ZeRO-1 does. A
cell that gains a parameter without a seam fails this test instead of silently holding it whole."""

from mindmoe.model.transformer import MoETransformer
from mindmoe.model.weights import FullWeight, seams
from mindmoe.train.parallel.fsdp import seamed_names
from tests.helpers.dsa_models import tiny_dsa_config

#: Parameters no seam reads: the DSA indexer's LayerNorm (small, read inside its own expression) and the router
#: correction bias (state the optimizer never sees).
UNSEAMED_SUFFIXES = (".indexer.k_norm.weight", ".indexer.k_norm.bias", ".e_score_correction_bias")


def test_every_parameter_of_an_mla_dsa_mtp_moe_model_but_the_indexer_norms_has_a_seam():
    model = MoETransformer(tiny_dsa_config(topk=4, mtp_layers=1, expert_bias=True, score_func="sigmoid"))
    names = {param.name for param in model.get_parameters()}
    found = seams(model)
    assert set(found) == seamed_names(model)
    unseamed = sorted(names - set(found))
    assert unseamed and all(name.endswith(UNSEAMED_SUFFIXES) for name in unseamed), unseamed
    # Embedding, head, attention projections, norms, routers, shared and routed experts, the MTP depth.
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.1.mlp.router.weight"):
        assert name in found
    assert any(name.startswith("mtp_layers.0.") for name in found)
    assert any(name.endswith("mlp.experts.gate_proj") for name in found)
    # Each seam is the identity cell until ZeRO-2/3 replaces it, attached to the cell holding the parameter.
    for name, (cell, attribute) in found.items():
        assert isinstance(getattr(cell, attribute), FullWeight)
        assert getattr(cell, attribute[: -len("_full")]).name == name

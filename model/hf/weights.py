"""Parameter names HF <-> mindmoe per architecture (the shapes a config implies: :mod:`model.param_count`).

A rule pairs a HF name template with ours. ``{layer}`` and ``{expert}`` are indices, any other
``{slot}`` is a closed set of words: a tuple (same word on both sides) or a dict (HF word -> ours,
e.g. Mixtral's ``w1`` -> ``gate_proj``). A HF name with ``{expert}`` is row ``expert`` of our
stacked ``[E, out, in]`` expert parameter, whose name has no ``{expert}``.
"""

import re
from dataclasses import dataclass

SWIGLU = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Rule:
    hf: str
    ours: str
    slots: tuple = ()  # ((slot name, tuple of words | dict HF word -> our word), ...)

    def _pattern(self, template: str, to_ours: bool) -> re.Pattern:
        slot_words = {"layer": [r"\d+"], "expert": [r"\d+"]}
        for name, words in self.slots:
            words = words if not isinstance(words, dict) else (words if to_ours else words.values())
            slot_words[name] = [re.escape(word) for word in words]
        regex = re.escape(template)
        for name, words in slot_words.items():
            regex = regex.replace(re.escape("{" + name + "}"), f"(?P<{name}>{'|'.join(words)})")
        return re.compile(f"^{regex}$")

    def _translate(self, match: re.Match, to_ours: bool) -> dict:
        values = match.groupdict()
        for name, words in self.slots:
            if isinstance(words, dict):
                values[name] = words[values[name]] if to_ours else {v: k for k, v in words.items()}[values[name]]
        return values


def _common_rules(extra_attention_weights: tuple, attention_weights=("q_proj", "k_proj", "v_proj", "o_proj")) -> list:
    return [
        Rule("model.embed_tokens.weight", "embed_tokens.weight"),
        Rule("model.norm.weight", "norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule(
            "model.layers.{layer}.{norm}.weight",
            "layers.{layer}.{norm}.weight",
            (("norm", ("input_layernorm", "post_attention_layernorm")),),
        ),
        Rule(
            "model.layers.{layer}.self_attn.{proj}.weight",
            "layers.{layer}.self_attn.{proj}.weight",
            (("proj", attention_weights + extra_attention_weights),),
        ),
    ]


def _router_and_expert_rules(moe: str, expert_words) -> list:
    return [
        Rule(f"model.layers.{{layer}}.{moe}.gate.weight", "layers.{layer}.mlp.router.weight"),
        Rule(
            f"model.layers.{{layer}}.{moe}.experts.{{expert}}.{{proj}}.weight",
            "layers.{layer}.mlp.experts.{proj}",
            (("proj", expert_words),),
        ),
    ]


DENSE_MLP = Rule("model.layers.{layer}.mlp.{proj}.weight", "layers.{layer}.mlp.{proj}.weight", (("proj", SWIGLU),))
QKV_BIAS = Rule(
    "model.layers.{layer}.self_attn.{proj}.bias",
    "layers.{layer}.self_attn.{proj}.bias",
    (("proj", ("q_proj", "k_proj", "v_proj")),),
)
QK_NORM = ("q_norm", "k_norm")
#: The weights of an MLA attention block (model/mla.py); q_proj replaces q_a/q_b when q_lora_rank is null.
MLA_WEIGHTS = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
SIGMOID_ROUTER_EXTRAS = [
    Rule("model.layers.{layer}.mlp.gate.e_score_correction_bias", "layers.{layer}.mlp.router.e_score_correction_bias"),
    Rule(
        "model.layers.{layer}.mlp.shared_experts.{proj}.weight",
        "layers.{layer}.mlp.shared_experts.{proj}.weight",
        (("proj", SWIGLU),),
    ),
]

RULES = {
    "glm4_moe": _common_rules(QK_NORM)
    + [QKV_BIAS, DENSE_MLP]
    + _router_and_expert_rules("mlp", SWIGLU)
    + SIGMOID_ROUTER_EXTRAS,
    "deepseek_v3": _common_rules((), MLA_WEIGHTS)
    + [DENSE_MLP]
    + _router_and_expert_rules("mlp", SWIGLU)
    + SIGMOID_ROUTER_EXTRAS,
    "qwen3_moe": _common_rules(QK_NORM) + [DENSE_MLP] + _router_and_expert_rules("mlp", SWIGLU),
    "mixtral": _common_rules(()) + _router_and_expert_rules("block_sparse_moe", MIXTRAL_EXPERT),
}
# transformers 5 fuses experts in memory but saves (and loads) deepseek_v3's per-expert names for glm4_moe_lite.
RULES["glm4_moe_lite"] = RULES["deepseek_v3"]
#: DeepSeek Sparse Attention's lightning indexer (model/dsa.py), the same names on both sides under ``model.``.
DSA_INDEXER = Rule(
    "model.layers.{layer}.self_attn.indexer.{part}",
    "layers.{layer}.self_attn.indexer.{part}",
    (("part", ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")),),
)
RULES["glm_moe_dsa"] = RULES["deepseek_v3"] + [DSA_INDEXER]


#: What an MTP depth (model/mtp.py) adds to a decoder layer's names; HF keeps the depth at ``model.layers.{L + k}``.
MTP_RULES = [
    Rule("model.layers.{layer}.{norm}.weight", "layers.{layer}.{norm}.weight", (("norm", ("enorm", "hnorm")),)),
    Rule("model.layers.{layer}.eh_proj.weight", "layers.{layer}.eh_proj.weight"),
    Rule("model.layers.{layer}.shared_head.norm.weight", "layers.{layer}.shared_head.norm.weight"),
]
#: Copies of the shared embedding and LM head that HF checkpoints store per MTP depth (mindmoe keeps one of each).
MTP_SHARED_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.head.weight": "head"}


class NameMap:
    """Translates names between a HF architecture and mindmoe.

    With ``num_layers`` (L) the HF layers from L on are MTP depths: ``model.layers.{L + k}.*`` <-> ``mtp_layers.{k}.*``.
    """

    def __init__(self, model_type: str, num_layers: int = None):
        self.model_type = model_type
        self.num_layers = num_layers
        self.rules = [
            (rule, rule._pattern(rule.hf, True), rule._pattern(rule.ours, False))
            for rule in RULES[model_type] + (MTP_RULES if num_layers is not None else [])
        ]

    def mtp_depth(self, hf_name: str):
        """The MTP depth of a HF name (its layer index minus L), or None for a main-model name."""
        layer = hf_layer_index(hf_name)
        if self.num_layers is None or layer is None or layer < self.num_layers:
            return None
        return layer - self.num_layers

    def to_ours(self, hf_name: str):
        """``(our name, expert row or None)``, or None when no rule matches."""
        depth = self.mtp_depth(hf_name)
        if depth is not None:
            found = self._to_ours(
                hf_name.replace(f"model.layers.{depth + self.num_layers}.", f"model.layers.{depth}.", 1)
            )
            if found is None:
                return None
            return found[0].replace(f"layers.{depth}.", f"mtp_layers.{depth}.", 1), found[1]
        return self._to_ours(hf_name)

    def _to_ours(self, hf_name: str):
        for rule, hf_pattern, _ in self.rules:
            match = hf_pattern.match(hf_name)
            if match:
                values = rule._translate(match, True)
                expert = values.pop("expert", None)
                return rule.ours.format(**values), None if expert is None else int(expert)
        return None

    def to_hf(self, our_name: str, num_rows: int = 0) -> list:
        """``[(HF name, expert row or None)]``: one name, or one per row of a stacked expert
        parameter (``num_rows`` rows). Raises KeyError for a name no rule knows."""
        if our_name.startswith("mtp_layers.") and self.num_layers is not None:
            depth = int(our_name.split(".")[1])
            inner = self._to_hf("layers." + our_name[len("mtp_layers.") :], num_rows)
            here, there = f"model.layers.{depth}.", f"model.layers.{self.num_layers + depth}."
            return [(name.replace(here, there, 1), row) for name, row in inner]
        return self._to_hf(our_name, num_rows)

    def _to_hf(self, our_name: str, num_rows: int) -> list:
        for rule, _, our_pattern in self.rules:
            match = our_pattern.match(our_name)
            if match:
                values = rule._translate(match, False)
                if "{expert}" not in rule.hf:
                    return [(rule.hf.format(**values), None)]
                return [(rule.hf.format(expert=row, **values), row) for row in range(num_rows)]
        raise KeyError(f"{our_name}: no {self.model_type} name for this mindmoe parameter")


def hf_layer_index(hf_name: str):
    """Decoder-layer index of a HF tensor name, or None."""
    match = HF_LAYER.match(hf_name)
    return int(match.group(1)) if match else None


def is_stacked_expert(our_name: str) -> bool:
    return ".mlp.experts." in our_name

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


class NameMap:
    """Translates names between a HF architecture and mindmoe."""

    def __init__(self, model_type: str):
        self.model_type = model_type
        self.rules = [
            (rule, rule._pattern(rule.hf, True), rule._pattern(rule.ours, False)) for rule in RULES[model_type]
        ]

    def to_ours(self, hf_name: str):
        """``(our name, expert row or None)``, or None when no rule matches."""
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

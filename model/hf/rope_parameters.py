"""``config.json`` files written by transformers 5 keep RoPE in one ``rope_parameters`` object
(``rope_type``, ``rope_theta``, ``partial_rotary_factor`` and the scaling keys) instead of the top-level
``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` of transformers 4.

:func:`with_transformers4_rope_keys` rewrites the first style into the second, so that one reader
(:mod:`model.hf.config_map`) imports both. The precedence is transformers 5.23's
(``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): a ``rope_scaling`` object present as well
replaces ``rope_parameters``; ``rope_theta`` and ``partial_rotary_factor`` inside the object win over
top-level ones.
"""

#: The keys of ``rope_parameters`` that are not scaling settings.
_BASE_KEYS = ("rope_theta", "partial_rotary_factor")


def with_transformers4_rope_keys(hf: dict):
    """``(config dict to read, problem or None)``. A config without ``rope_parameters`` is returned as is."""
    if "rope_parameters" not in hf:
        return hf, None
    rope = hf.get("rope_scaling") or hf["rope_parameters"]
    if rope is None:
        return hf, None
    if not isinstance(rope, dict) or any(isinstance(value, dict) for value in rope.values()):
        # transformers nests one object per attention layer type; no architecture mindmoe imports has those.
        return hf, "must be a flat object (RoPE per layer type is not supported)"
    view = dict(hf)
    for key in _BASE_KEYS:
        if key in rope:
            view[key] = rope[key]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    view["rope_scaling"] = None if rope_type == "default" else {k: v for k, v in rope.items() if k not in _BASE_KEYS}
    return view, None

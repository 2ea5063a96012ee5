"""Serving export: prefill/decode graphs over the training model's cells (:mod:`model.export.serving`),
the expert-lock state a decoder carries (:mod:`model.export.lock_state`), the MindIR writer
(:mod:`model.export.mindir`) and a reference runner for the written files (:mod:`model.export.runner`)."""

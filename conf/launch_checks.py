"""What ``mindmoe-launch`` checks before any worker starts: the whole config tree against the world it starts.

It lives with the config tree, not in ``launch/``: it reads every section (launch, parallel, data, train,
model), and ``launch/`` imports nothing of ``train/``.
"""

import dataclasses


def check_launch_config(cfg, hydra_overrides, task_overrides=()) -> None:
    """Everything that can be wrong before a worker starts, naming the key to change.

    ``hydra_overrides`` / ``task_overrides``: Hydra's ``overrides.hydra`` and ``overrides.task``.
    """
    from mindmoe.launch.msrun import validate_launch, world_size
    from mindmoe.model.config import validate_model_config
    from mindmoe.train.distributed import resolve_layout
    from mindmoe.train.init_model import explicit_model_keys, planned_model_config
    from mindmoe.train.loop import validate_run_config

    launch = cfg.launch
    validate_launch(launch)
    if launch.nodes > 1 and not any(o.startswith("hydra.run.dir=") for o in hydra_overrides):
        raise ValueError(
            f"launch.nodes={launch.nodes}: give every node the same shared run dir with "
            "hydra.run.dir=/shared/path (the default is a timestamp of each node's own clock)"
        )
    validate_run_config(cfg)
    # With model.pretrained the architecture is the directory's config.json (read here, as data).
    model = planned_model_config(cfg, explicit_model_keys(task_overrides))
    # The real vocabulary comes from the tokenizer; any positive size checks the other keys.
    validate_model_config(dataclasses.replace(model, vocab_size=model.vocab_size or cfg.data.vocab_size))
    resolve_layout(
        world_size(launch),
        cfg.parallel.dp,
        cfg.parallel.ep,
        model.num_experts,
        cfg.data.global_batch_size,
        cfg.data.micro_batch_size,
        model.num_layers > model.first_k_dense,
    )

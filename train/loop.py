"""The training run: data -> model -> compiled step -> logs, validation and checkpoints.

Reads top to bottom: :func:`run` is the whole job of ``mindmoe-train``.
"""

import dataclasses
import logging
import math
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from mindmoe.data.mindrecord import EvalLoader, WindowLoader
from mindmoe.data.prepare import prepare_data, with_pretrained_tokenizer
from mindmoe.train.checkpoint import load_model_weights, load_optimizer_state, read_state, save_checkpoint
from mindmoe.train.distributed import init_distributed
from mindmoe.train.heatmap import render_expert_load, save_png
from mindmoe.train.init_model import build_model, planned_model_config
from mindmoe.train.lora_setup import setup_lora
from mindmoe.train.metrics import MetricsWriter, measure_peak_gflops, train_flops_per_token, window_row
from mindmoe.train.optim import build_optimizer
from mindmoe.train.precision import apply_precision, validate_precision
from mindmoe.train.resume import StopRequest, TrainingStopped, pick_resume_checkpoint
from mindmoe.train.routing import RouterStepUpdates
from mindmoe.train.step import Trainer

log = logging.getLogger("mindmoe.train")


def validate_run_config(cfg) -> None:
    """Checks across sections that the dataclasses alone cannot express, naming the key."""
    data, train = cfg.data, cfg.train
    if data.micro_batch_size < 1 or data.global_batch_size % data.micro_batch_size:
        raise ValueError(
            f"data.global_batch_size={data.global_batch_size} must be a positive multiple of "
            f"data.micro_batch_size={data.micro_batch_size}"
        )
    for key in ("max_steps", "log_every", "save_every"):
        if getattr(train, key) < 1:
            raise ValueError(f"train.{key}={getattr(train, key)} must be >= 1")
    if not 0 <= train.warmup_ratio < 1:
        raise ValueError(f"train.warmup_ratio={train.warmup_ratio} must be in [0, 1)")
    validate_precision(train, ms.get_context("device_target"))
    if train.max_bad_steps < 1:
        raise ValueError(f"train.max_bad_steps={train.max_bad_steps} must be >= 1")
    if train.on_corrupt_checkpoint not in ("error", "previous"):
        raise ValueError(f"train.on_corrupt_checkpoint={train.on_corrupt_checkpoint!r} must be 'error' or 'previous'")
    if train.resume not in ("auto", "none") and not Path(train.resume).expanduser().exists():
        raise ValueError(f"train.resume={train.resume!r}: not 'auto', 'none' or an existing checkpoint directory")


def run(cfg, run_dir: Path, explicit_model_keys=()) -> dict:
    """Train as configured, writing everything into ``run_dir``; returns the final summary.

    ``explicit_model_keys``: the ``model.*`` fields set on the command line, which are the only
    model keys that apply on top of a ``model.pretrained`` config.json. Under msrun every worker
    runs this with the same config and run dir; rank 0 alone writes ``metrics.jsonl``, TensorBoard
    events and checkpoints.
    """
    validate_run_config(cfg)
    run_dir = Path(run_dir)
    ms.set_context(mode=ms.GRAPH_MODE)
    planned = planned_model_config(cfg, explicit_model_keys)
    dist = init_distributed(
        cfg.parallel,
        planned.num_experts,
        cfg.data.global_batch_size,
        cfg.data.micro_batch_size,
        planned.num_moe_layers > 0,
    )
    if cfg.lora.enabled and dist.layout.ep > 1:
        raise ValueError(
            f"lora.enabled=true with parallel.ep={dist.layout.ep}: LoRA runs are data parallel only; set parallel.ep=1"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    ms.set_seed(cfg.train.seed)

    prepared = prepare_data(with_pretrained_tokenizer(cfg.data, cfg.model.pretrained))
    checkpoint_root = run_dir / "checkpoints"
    resume_from = pick_resume_checkpoint(cfg.train.resume, checkpoint_root, cfg.train.on_corrupt_checkpoint)
    # A LoRA checkpoint holds only the adapters: its base is loaded again when resuming.
    model_cfg, model = build_model(
        cfg, prepared.vocab_size, explicit_model_keys, load_weights=resume_from is None or cfg.lora.enabled
    )
    model_cfg, model, lora_run = setup_lora(cfg, model_cfg, model, prepared.vocab_size)
    if cfg.data.seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
            f"{model_cfg.max_position_embeddings}"
        )
    train_cfg = OmegaConf.to_object(cfg.train)

    dist.parallelize(model)
    loss_scale = apply_precision(model, cfg.train)
    optimizer = build_optimizer(model.trainable_params(), train_cfg)
    optimizer_state = list(optimizer.exp_avg) + list(optimizer.exp_avg_sq) + [optimizer.global_step]
    accum_steps = dist.layout.accumulation
    trainer = Trainer(
        model, optimizer, cfg.train.grad_clip, accum_steps, RouterStepUpdates(model, model_cfg), dist, loss_scale
    )
    optimizer_state += trainer.loss_scale_state
    # Checkpoints hold every parameter, including state the optimizer never sees (router biases),
    # expert tensors at full size whatever parallel.ep is; a LoRA run's hold its adapters only.
    model_state = dist.checkpoint_views(model.get_parameters() if lora_run is None else lora_run.checkpoint_params)
    optimizer_state = dist.checkpoint_views(optimizer_state)
    moe_layer_ids = [idx for idx, layer in enumerate(model.layers) if layer.is_moe]

    start_step = 0
    if resume_from is not None:
        load_model_weights(model_state, resume_from)
        load_optimizer_state(optimizer_state, resume_from)
        start_step = read_state(resume_from)["step"]
        log.info("resumed from %s at step %d", resume_from, start_step)

    loader = WindowLoader(
        prepared.train_shards,
        micro_batch_size=cfg.data.micro_batch_size,
        global_batch_size=cfg.data.global_batch_size,
        seed=cfg.train.seed,
        start_step=start_step,
        rank=dist.dp_rank,
        world_size=dist.dp,
    )
    batches = iter(loader)

    n_params = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops_per_token = train_flops_per_token(model_cfg, cfg.data.seq_len)
    peak_gflops = cfg.train.peak_gflops or measure_peak_gflops()
    log.info(
        "model: %d parameters, %.2f MFLOP/token (train), peak %.1f GFLOP/s; %d train windows, "
        "accumulation %d, data parallel %d",
        n_params,
        flops_per_token / 1e6,
        peak_gflops,
        prepared.num_train_windows,
        accum_steps,
        dist.dp,
    )
    metrics = MetricsWriter(run_dir) if dist.is_main else None
    if dist.is_main:
        OmegaConf.save(cfg, run_dir / "resolved_config.yaml", resolve=True)

    def checkpoint(step):
        if not dist.is_main:
            if dist.sharded:
                # Gathering the expert shards is collective: every rank takes part, rank 0 writes.
                for tensor in model_state + optimizer_state:
                    if tensor.name in dist.sharded or tensor.name.split(".", 1)[-1] in dist.sharded:
                        tensor.asnumpy()
            return checkpoint_root / f"step_{step:06d}"
        state = {
            "data_seed": cfg.train.seed,
            "tokens_seen": step * tokens_per_step,
            "tokenizer": prepared.tokenizer_path,
            "model_config": dataclasses.asdict(model_cfg),
        }
        return save_checkpoint(
            checkpoint_root,
            step,
            model_state,
            optimizer_state,
            state,
            cfg.train.keep_last,
            None if lora_run is None else lora_run.write_adapter,
        )

    def validate(step):
        if not prepared.valid_shards:
            return None
        # train.eval_batches counts micro-batches over all ranks: the same windows at any dp.
        val_batches = EvalLoader(
            prepared.valid_shards,
            cfg.data.micro_batch_size,
            rank=dist.dp_rank,
            world_size=dist.dp,
            max_batches=-(-cfg.train.eval_batches // dist.dp),
        )
        val_loss, val_tokens = trainer.evaluate(val_batches)
        if metrics is None:
            return val_loss
        metrics.write(
            {
                "step": step,
                "val_loss": val_loss,
                "val_ppl": math.exp(min(val_loss, 50.0)),
                "val_tokens": int(val_tokens),
            }
        )
        return val_loss

    def log_window(step, window, seconds, skipped_steps):
        row = window_row(step, window, seconds, tokens_per_step, flops_per_token, peak_gflops, skipped_steps)
        if metrics is None:
            return row
        if moe_layer_ids:
            routing_L3E = np.sum([s.routing_stats for s in window], axis=0)
            heatmap = render_expert_load(routing_L3E[:, 0], moe_layer_ids, f"expert load share, to step {step}")
            save_png(heatmap, run_dir / "expert_load.png")
            metrics.image("expert_load", heatmap, step)
        metrics.write(row)
        return row

    # The base model's validation loss, for comparing a fine-tuned run against its starting point.
    base_val_loss = validate(0) if lora_run is not None and start_step == 0 else None
    window, window_seconds = [], 0.0
    first_loss = None
    bad_steps_in_row = skipped_steps = 0
    show_progress = cfg.train.progress_bar and dist.is_main
    progress = tqdm(
        total=cfg.train.max_steps, initial=start_step, disable=not show_progress, unit="step", dynamic_ncols=True
    )
    with StopRequest() as stop:
        for step in range(start_step + 1, cfg.train.max_steps + 1):
            step_start = time.perf_counter()
            stats = trainer.step([next(batches) for _ in range(accum_steps)])
            # Step time only: validation and checkpoint writes are not training throughput.
            window_seconds += time.perf_counter() - step_start
            window.append(stats)
            first_loss = stats.lm_loss if first_loss is None else first_loss
            bad_steps_in_row = bad_steps_in_row + 1 if stats.skipped else 0
            skipped_steps += int(stats.skipped)
            if stats.skipped:
                log.warning(
                    "step %d: non-finite loss %.4g or gradient norm %.4g; update skipped (%d in a row)",
                    step,
                    stats.loss,
                    stats.grad_norm,
                    bad_steps_in_row,
                )
            if bad_steps_in_row >= cfg.train.max_bad_steps:
                raise FloatingPointError(
                    f"{bad_steps_in_row} consecutive steps up to step {step} had a non-finite loss or gradient "
                    f"(train.max_bad_steps={cfg.train.max_bad_steps}); last loss {stats.loss}, gradient norm "
                    f"{stats.grad_norm}. Lower train.lr, check the data, or resume from an earlier checkpoint."
                )
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                row = log_window(step, window, window_seconds, skipped_steps)
                progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                window, window_seconds = [], 0.0
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != cfg.train.max_steps:
                validate(step)
            # A signal reaches the ranks of a job at slightly different steps: all stop at the step
            # where the first one saw it, so rank 0's checkpoint is the one every rank would resume.
            stop_now = dist.any_rank(stop.signal_name is not None)
            if step % cfg.train.save_every == 0 or step == cfg.train.max_steps or stop_now:
                saved = checkpoint(step)
                if stop_now:
                    if metrics is not None:
                        metrics.close()
                    # msrun stops the whole job when one worker exits: none leaves before the write.
                    dist.any_rank(False)
                    received = stop.signal_name or "a stop signal on another rank"
                    raise TrainingStopped(
                        f"received {received}: checkpoint of step {step} written to "
                        f"{saved}; run the same command again (train.resume=auto) to continue"
                    )
            progress.update(1)
    progress.close()
    val_loss = validate(cfg.train.max_steps)
    if metrics is None:
        return {"steps": cfg.train.max_steps, "final_val_loss": val_loss, "run_dir": str(run_dir)}
    metrics.close()
    summary = {
        "steps": cfg.train.max_steps,
        "first_lm_loss": first_loss,
        "final_val_loss": val_loss,
        "unigram_val_loss": prepared.unigram_val_loss,
        "run_dir": str(run_dir),
    }
    if lora_run is not None:
        summary.update(
            base_val_loss=base_val_loss,
            trainable_params=lora_run.report.trainable,
            trainable_share=lora_run.report.share,
        )
        if base_val_loss is not None and val_loss is not None:
            print(
                f"LoRA: validation loss {base_val_loss:.4f} before fine-tuning, {val_loss:.4f} after; adapters "
                f"in {checkpoint_root}/step_{cfg.train.max_steps:06d}/adapter"
            )
    if val_loss is not None and prepared.unigram_val_loss is not None:
        print(
            f"validation loss {val_loss:.4f} nats/token vs unigram baseline "
            f"{prepared.unigram_val_loss:.4f} (better by {prepared.unigram_val_loss - val_loss:.4f})"
        )
    print(f"run dir: {run_dir}")
    return summary

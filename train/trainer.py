"""The training run: data -> model -> compiled step -> logs, validation and checkpoints.

Reads top to bottom: :class:`Trainer` builds everything a run needs in ``__init__``; :meth:`Trainer.train`
is the loop. Under msrun every worker runs it with the same config and run dir; rank 0 alone writes
``metrics.jsonl``, TensorBoard events and checkpoints.
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
from mindmoe.data.prepare import prepare_data
from mindmoe.model.kernels import native
from mindmoe.model.kernels.host_runtime import configure_host_runtime, describe
from mindmoe.train.bad_steps import BadStepCounter
from mindmoe.train.checkpoints.checkpoint import (
    CarriedFiles,
    load_model_weights,
    load_optimizer_state,
    read_state,
    save_checkpoint,
)
from mindmoe.train.checkpoints.lineage import settle_lineage
from mindmoe.train.checkpoints.resume import (
    StopRequest,
    TrainingStopped,
    dropout_checkpoint_state,
    pick_resume_checkpoint,
    restore_dropout,
)
from mindmoe.train.checkpoints.resume_checks import TOKENIZER_LABEL, architecture, check_resume, run_state
from mindmoe.train.checkpoints.tokenizer import run_data_config
from mindmoe.train.dsa_stage import continue_schedule, enter_stage, stage_at, switches_after
from mindmoe.train.graph_memory import release_compiled_graphs, validates_before_last_step
from mindmoe.train.heatmap import render_expert_load, save_png
from mindmoe.train.held_memory import describe as describe_held
from mindmoe.train.held_memory import held_bytes
from mindmoe.train.init_model import build_model, planned_model_config
from mindmoe.train.lora_setup import lora_run_for
from mindmoe.train.metrics import MetricsWriter, measure_peak_gflops, param_table, train_flops_per_token, window_row
from mindmoe.train.optim import build_optimizer
from mindmoe.train.outcome import report_outcome
from mindmoe.train.parallel import fsdp
from mindmoe.train.parallel.distributed import init_distributed
from mindmoe.train.precision import apply_precision, masters
from mindmoe.train.routing import RouterStepUpdates
from mindmoe.train.step import CompiledStep, StepStats

log = logging.getLogger("mindmoe.train")


class Trainer:
    """One training run of ``cfg`` (already checked by ``train.loop.validate_run_config``) in ``run_dir``.

    ``explicit_model_keys``: the ``model.*`` fields set explicitly (command line, chosen recipe or
    non-default model group: :mod:`conf.explicit_keys`), the only model keys that apply on top of a
    ``model.pretrained`` config.json. ``run_lock``: the :class:`train.checkpoints.run_lock.RunLock` of ``run_dir``,
    by rank 0 once the process layout is known, before anything is written (None: no lock).
    """

    def __init__(self, cfg, run_dir: Path, explicit_model_keys=(), run_lock=None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_lock = run_lock
        self.checkpoint_root = self.run_dir / "checkpoints"
        ms.set_context(mode=ms.GRAPH_MODE)
        self.host_runtime = configure_host_runtime()
        self.model_cfg, self.model = self._build_model(explicit_model_keys)
        self.dsa_stage = stage_at(self.model, 0 if self.resume_state is None else self.resume_state["step"])
        enter_stage(self.model, self.dsa_stage)
        self.compiled_step = self._compile_step()
        self.moe_layer_ids = [idx for idx, layer in enumerate(self.model.layers) if layer.is_moe]
        self.start_step = self._resume()
        self.batches = iter(self._train_loader())
        self.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
        # Frozen weights (LoRA) spend no weight-gradient FLOPs.
        self.flops_per_token = train_flops_per_token(self.model_cfg, cfg.data.seq_len, self._param_table())
        self.peak_gflops = cfg.train.peak_gflops or measure_peak_gflops()
        self._log_model()
        self.metrics = MetricsWriter(self.run_dir, self.start_step) if self.dist.is_main else None
        self._write_held_bytes()
        if self.dist.is_main:
            OmegaConf.save(cfg, self.run_dir / "resolved_config.yaml", resolve=True)
        # The steps since the last metrics row, and the counts of skipped (non-finite or fp16 overflow) steps.
        self.window, self.window_seconds = [], 0.0
        self.first_loss = None
        self.bad_steps = BadStepCounter(cfg.train.max_bad_steps)

    def _build_model(self, explicit_model_keys):
        """The process layout, the data (its tokenizer sets the vocabulary), then the model, parallelized.

        The one place that decides how the model is built and distributed; sets ``dist``, ``data``,
        ``resume_from`` (with ``resume_state``, its ``state.json``, read once) and ``lora_run`` on the way, in the
        order each needs the one before.
        """
        cfg = self.cfg
        planned = planned_model_config(cfg, explicit_model_keys)
        if cfg.data.seq_len > planned.max_position_embeddings:
            # Known before the tokenizer is trained and the data packed, which take long on a real corpus.
            raise ValueError(
                f"data.seq_len={cfg.data.seq_len} exceeds max_position_embeddings={planned.max_position_embeddings} "
                f"of {_positions_source(cfg)}"
            )
        self.dist = init_distributed(
            cfg.parallel,
            planned.num_experts,
            cfg.data.global_batch_size,
            cfg.data.micro_batch_size,
            planned.num_moe_layers > 0,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main and self.run_lock is not None:
            self.run_lock.acquire()  # rank 0 writes the run dir: one run at a time
        ms.set_seed(cfg.train.seed)
        self.resume_from = pick_resume_checkpoint(
            cfg.train.resume, self.checkpoint_root, cfg.train.on_corrupt_checkpoint, hash_files=not self.dist.active
        )
        self.resume_state = None if self.resume_from is None else read_state(self.resume_from)
        if self.resume_from is not None:  # before anything in the run dir changes for it
            current = {"data.seq_len": cfg.data.seq_len, "train.seed": cfg.train.seed, **architecture(planned)}
            check_resume(self.resume_from, self.resume_state, current, cfg.train.resume_allow_changes)
        # Rank 0 moves aside the step_* directories this run does not continue, after every rank chose.
        settle_lineage(self.checkpoint_root, self.resume_from, self.dist)
        # A resumed run (or a lora.base_checkpoint) reads the tokenizer its checkpoint carries. Rank 0 writes the
        # shards; the other ranks wait for its cache entry and hash no data file.
        self.data = prepare_data(run_data_config(cfg, self.resume_from), writer=self.dist.is_main)
        # Read once: a resumed run's tokenizer lives in a checkpoint that train.keep_last may prune.
        self.carried = CarriedFiles.of_run(self.data.tokenizer_path, OmegaConf.to_yaml(cfg, resolve=True))
        # A LoRA checkpoint holds only the adapters: its base is loaded again when resuming.
        model_cfg, model = build_model(
            cfg,
            self.data.vocab_size,
            explicit_model_keys,
            load_weights=self.resume_from is None or cfg.lora.enabled,
            expert_dispatcher=self.dist.expert_dispatcher,
        )
        self.lora_run = lora_run_for(cfg, model_cfg, model)
        self.dist.track_expert_shards(model)
        return model_cfg, model

    def _compile_step(self) -> CompiledStep:
        """Precision, optimizer and the compiled step; sets the tensors a checkpoint holds."""
        model, train_cfg = self.model, OmegaConf.to_object(self.cfg.train)
        loss_scale = apply_precision(model, self.cfg.train)
        zero, previous = self.cfg.parallel.zero, getattr(self, "compiled_step", None)
        seamed, held = (fsdp.seamed_names(model) if zero >= 2 else frozenset()), fsdp.held_ranges(model)
        optimizer = build_optimizer(
            model.trainable_params(), train_cfg, self.dist, zero, None, seamed, held, masters(train_cfg)
        )
        # The dense warm-up of DSA trains only the indexers: the routers stay as they are.
        router_updates = None if self.dsa_stage == "dense_warmup" else RouterStepUpdates(model, self.model_cfg)
        accum_steps = self.dist.layout.accumulation
        step = CompiledStep(
            model,
            optimizer,
            self.cfg.train.grad_clip,
            accum_steps,
            router_updates,
            self.dist,
            loss_scale,
            mtp_loss_coeff=self.cfg.train.mtp_loss_coeff,
        )
        # The shapes as built (ZeRO-3 holds ranges next), for the FLOPs and the parameter count.
        if not hasattr(self, "full_shapes"):
            self.full_shapes = {name: shape for name, (shape, _) in param_table(model).items()}
        fsdp.shard_state(model, optimizer, previous and previous.optimizer)  # after all that reads whole shapes
        optimizer_state = [*optimizer.exp_avg, *optimizer.exp_avg_sq, optimizer.global_step, *step.loss_scale_state]
        # Checkpoints hold every parameter, including state the optimizer never sees (router biases),
        # expert tensors at full size whatever parallel.ep is; a LoRA run's hold its adapters only.
        params = model.get_parameters() if self.lora_run is None else self.lora_run.checkpoint_params
        self.model_state = self.dist.checkpoint_views(params)
        self.optimizer_state = self.dist.checkpoint_views(optimizer_state)
        return step

    def _resume(self) -> int:
        """Load the checkpoint chosen by ``train.resume`` into model and optimizer; the step it was taken at."""
        # What state.json records for the next resume to check (seed and architecture are recorded anyway).
        self.run_state = run_state(self.cfg.data.seq_len, self.data.tokenizer_path)
        if self.resume_from is not None:
            # The rest was checked before the data was prepared; the vocabulary is known only now.
            current = {
                TOKENIZER_LABEL: self.run_state["tokenizer_sha256"],
                "model.vocab_size": self.model_cfg.vocab_size,
            }
            check_resume(self.resume_from, self.resume_state, current, self.cfg.train.resume_allow_changes)
        restore_dropout(self.model, self.dist.dp_rank, self.resume_state)
        if self.resume_from is None:
            return 0
        # One process verified every file when it chose the checkpoint; ranks of a job hash what they read.
        load_model_weights(self.model_state, self.resume_from, self.dist)
        load_optimizer_state(self.optimizer_state, self.resume_from, self.dist)
        if hasattr(self.compiled_step.optimizer, "refresh_weights"):  # half-precision weights from their masters
            self.compiled_step.optimizer.refresh_weights()
        start_step = self.resume_state["step"]
        log.info("resumed from %s at step %d", self.resume_from, start_step)
        return start_step

    def _train_loader(self) -> WindowLoader:
        data = self.cfg.data
        return WindowLoader(
            self.data.train_shards,
            micro_batch_size=data.micro_batch_size,
            global_batch_size=data.global_batch_size,
            seed=self.cfg.train.seed,
            start_step=self.start_step,
            rank=self.dist.dp_rank,
            world_size=self.dist.dp,
        )

    def _param_table(self) -> dict:
        """:func:`train.metrics.param_table` with the shapes as built (ZeRO-3 holds ranges)."""
        return {p.name: (self.full_shapes[p.name], bool(p.requires_grad)) for p in self.model.get_parameters()}

    def _write_held_bytes(self) -> None:
        """The ``held_bytes`` row (train/held_memory.py): rank 0's Parameters by kind, before the first step."""
        held = held_bytes(self.model, self.compiled_step)
        if self.metrics is not None:
            self.metrics.write({"step": self.start_step, "held_bytes": held})
            log.info(describe_held(held))

    def _log_model(self) -> None:
        log.info(
            "model: %d parameters, %.2f MFLOP/token (train), peak %.1f GFLOP/s; %d train windows, "
            "accumulation %d, data parallel %d",
            sum(int(np.prod(shape)) for shape, trained in self._param_table().values() if trained),
            self.flops_per_token / 1e6,
            self.peak_gflops,
            self.data.num_train_windows,
            self.compiled_step.accum_steps,
            self.dist.dp,
        )
        log.info(describe(self.host_runtime))
        if self.host_runtime["device_target"] == "CPU":
            log.info(native.status())

    def train(self) -> dict:
        """Steps ``start_step + 1 .. train.max_steps`` with their logs, validations and checkpoints; the summary."""
        train = self.cfg.train
        # The base model's validation loss, for comparing a fine-tuned run against its starting point.
        base_val_loss = self.validate(0) if self.lora_run is not None and self.start_step == 0 else None
        if base_val_loss is not None and not validates_before_last_step(train.eval_every, 0, train.max_steps):
            release_compiled_graphs()  # the evaluation graph runs next after the last step
        show_progress = train.progress_bar and self.dist.is_main
        progress = tqdm(
            total=train.max_steps, initial=self.start_step, disable=not show_progress, unit="step", dynamic_ncols=True
        )
        with StopRequest() as stop:
            for step in range(self.start_step + 1, train.max_steps + 1):
                self.train_step(step)
                if switches_after(self.model, step):
                    self._end_dsa_warmup(step)
                if step % train.log_every == 0 or step == train.max_steps:
                    row = self.log(step)
                    progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if train.eval_every and step % train.eval_every == 0 and step != train.max_steps:
                    self.validate(step)
                self._save_or_stop(step, stop)
                progress.update(1)
        progress.close()
        release_compiled_graphs()  # training is over: the final validation reuses its graphs' memory
        val_loss = self.validate(train.max_steps)
        return self._finish(val_loss, base_val_loss)

    def train_step(self, step: int) -> StepStats:
        """One optimizer step over the next global batch; raises once ``train.max_bad_steps`` in a row were bad."""
        step_start = time.perf_counter()
        stats = self.compiled_step.step([next(self.batches) for _ in range(self.compiled_step.accum_steps)])
        # Step time only: validation and checkpoint writes are not training throughput.
        self.window_seconds += time.perf_counter() - step_start
        self.window.append(stats)
        self.first_loss = stats.lm_loss if self.first_loss is None else self.first_loss
        self.bad_steps.record(step, stats)
        return stats

    def _end_dsa_warmup(self, step: int) -> None:
        """After the last warm-up step: every parameter trains, with sparse attention (train/dsa_stage.py)."""
        self.dsa_stage = stage_at(self.model, step)
        enter_stage(self.model, self.dsa_stage)
        self.compiled_step = self._compile_step()
        continue_schedule(self.compiled_step.optimizer, step)
        log.info("DSA: dense warm-up done after step %d; training sparse, every parameter", step)

    def log(self, step: int) -> dict:
        """The metrics row of the steps since the last one (written by rank 0, with the expert-load heatmap)."""
        row = window_row(
            step,
            self.window,
            self.window_seconds,
            self.tokens_per_step,
            self.flops_per_token,
            self.peak_gflops,
            self.bad_steps.skipped,
        )
        if self.metrics is not None:
            if self.moe_layer_ids:
                routing_L3E = np.sum([s.routing_stats for s in self.window], axis=0)
                title = f"expert load share, to step {step}"
                heatmap = render_expert_load(routing_L3E[:, 0], self.moe_layer_ids, title)
                save_png(heatmap, self.run_dir / "expert_load.png")
                self.metrics.image("expert_load", heatmap, step)
            self.metrics.write(row)
        self.window, self.window_seconds = [], 0.0
        return row

    def validate(self, step: int):
        """Mean validation loss over ``train.eval_batches`` micro-batches (None without validation data)."""
        if not self.data.valid_shards:
            return None
        dist = self.dist
        # train.eval_batches counts micro-batches over all ranks: the same windows at any dp.
        val_batches = EvalLoader(
            self.data.valid_shards,
            self.cfg.data.micro_batch_size,
            rank=dist.dp_rank,
            world_size=dist.dp,
            max_batches=-(-self.cfg.train.eval_batches // dist.dp),
        )
        val_loss, val_tokens = self.compiled_step.evaluate(val_batches)
        if self.metrics is not None:
            self.metrics.write(
                {
                    "step": step,
                    "val_loss": val_loss,
                    "val_ppl": math.exp(min(val_loss, 50.0)),
                    "val_tokens": int(val_tokens),
                }
            )
        return val_loss

    def save(self, step: int) -> Path:
        """The checkpoint of ``step``: every rank writes the parts it owns, rank 0 the rest (train/checkpoints/)."""
        state = {
            "data_seed": self.cfg.train.seed,
            "tokens_seen": step * self.tokens_per_step,
            "model_config": dataclasses.asdict(self.model_cfg),
            "moe_config": dataclasses.asdict(self.model.moe_config),
            "dsa_config": dataclasses.asdict(self.model.dsa_training),
            **self.run_state,
            **dropout_checkpoint_state(self.model),
        }
        return save_checkpoint(
            self.checkpoint_root,
            step,
            self.model_state,
            self.optimizer_state,
            state,
            self.cfg.train.keep_last,
            None if self.lora_run is None else self.lora_run.write_adapter,
            self.carried,
            self.dist,
        )

    def _save_or_stop(self, step: int, stop: StopRequest) -> None:
        """Checkpoint at ``train.save_every``, the last step, or when any rank received a stop signal (then stop)."""
        train = self.cfg.train
        # A signal reaches the ranks of a job at slightly different steps: all stop at the step
        # where the first one saw it, so rank 0's checkpoint is the one every rank would resume.
        stop_now = self.dist.any_rank(stop.signal_name is not None)
        if not (step % train.save_every == 0 or step == train.max_steps or stop_now):
            return
        saved = self.save(step)
        if not stop_now:
            return
        if self.metrics is not None:
            self.metrics.close()
        # msrun stops the whole job when one worker exits: none leaves before the write.
        self.dist.any_rank(False)
        received = stop.signal_name or "a stop signal on another rank"
        raise TrainingStopped(
            f"received {received}: checkpoint of step {step} written to "
            f"{saved}; run the same command again (train.resume=auto) to continue"
        )

    def _finish(self, val_loss, base_val_loss) -> dict:
        """Close the metrics, print the outcome (rank 0) and return the run's summary."""
        max_steps = self.cfg.train.max_steps
        if self.metrics is None:
            return {"steps": max_steps, "final_val_loss": val_loss, "run_dir": str(self.run_dir)}
        self.metrics.close()
        return report_outcome(self, val_loss, base_val_loss)


def _positions_source(cfg) -> str:
    """Where the run's ``max_position_embeddings`` comes from, and what the user can change."""
    if cfg.lora.enabled and cfg.lora.base_checkpoint:
        return f"lora.base_checkpoint={cfg.lora.base_checkpoint} (its state.json); lower data.seq_len"
    if cfg.model.pretrained:
        return (
            f"model.pretrained={cfg.model.pretrained} (its config.json); lower data.seq_len or set "
            "model.max_position_embeddings (with model.rope_scaling for longer contexts)"
        )
    return "model.max_position_embeddings; lower data.seq_len or raise model.max_position_embeddings"

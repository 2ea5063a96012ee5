"""What a finished run prints (rank 0) and returns: its summary, the validation loss against the unigram
baseline and, for LoRA, against the base model."""


def report_outcome(trainer, val_loss, base_val_loss) -> dict:
    """The summary of ``trainer``'s finished run (:class:`train.trainer.Trainer`), printed as it is returned."""
    max_steps = trainer.cfg.train.max_steps
    unigram_val_loss = trainer.data.unigram_val_loss
    summary = {
        "steps": max_steps,
        "first_lm_loss": trainer.first_loss,
        "final_val_loss": val_loss,
        "unigram_val_loss": unigram_val_loss,
        "run_dir": str(trainer.run_dir),
    }
    if trainer.lora_run is not None:
        summary.update(
            base_val_loss=base_val_loss,
            trainable_params=trainer.lora_run.report.trainable,
            trainable_share=trainer.lora_run.report.share,
        )
        if base_val_loss is not None and val_loss is not None:
            print(
                f"LoRA: validation loss {base_val_loss:.4f} before fine-tuning, {val_loss:.4f} after; adapters "
                f"in {trainer.checkpoint_root}/step_{max_steps:06d}/adapter"
            )
    if val_loss is not None and unigram_val_loss is not None:
        print(
            f"validation loss {val_loss:.4f} nats/token vs unigram baseline "
            f"{unigram_val_loss:.4f} (better by {unigram_val_loss - val_loss:.4f})"
        )
    print(f"run dir: {trainer.run_dir}")
    return summary

"""``mindmoe-data``: train/load the tokenizer and write the packed MindRecord shards ahead of training.

Training does the same on demand; running it first (once per cluster node or shared cache)
keeps workers from waiting on each other.
"""

import sys

import hydra

from mindmoe.conf.exit_codes import reports_errors
from mindmoe.conf.moved_keys import exit_on_moved_keys
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs

register_configs()


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-data")
def _main(cfg) -> None:
    from mindmoe.data.prepare import prepare_data, with_pretrained_tokenizer

    prepared = prepare_data(with_pretrained_tokenizer(cfg.data, cfg.model.pretrained))
    print(f"tokenizer: {prepared.tokenizer_path} (vocab {prepared.vocab_size})")
    print(f"train: {prepared.num_train_windows} windows in {len(prepared.train_shards)} shard(s)")
    print(f"valid: {prepared.num_valid_windows} windows in {len(prepared.valid_shards)} shard(s)")
    if prepared.unigram_val_loss is not None:
        print(f"unigram validation loss: {prepared.unigram_val_loss:.4f} nats/token")


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-data", sys.argv[1:])
    _main()

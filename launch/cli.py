"""``mindmoe-launch``: start this node's training workers with ``msrun``.

    mindmoe-launch launch.procs_per_node=8 train.max_steps=1000            # one node, 8 workers
    mindmoe-launch launch.dry_run=true launch.nodes=4 launch.procs_per_node=8 \\
        launch.node_rank=3 launch.master_addr=10.0.0.1 hydra.run.dir=/shared/run1

Takes the ``mindmoe-train`` config tree plus ``launch.*``. Before any worker starts it checks
that the world divides as configured and prepares the tokenizer and MindRecord shards (cached,
so the workers find them). Every worker gets the same overrides and the same run dir. When a
worker dies, msrun stops the others; this command then exits non-zero naming the failed rank's
log and quoting its first error line (:mod:`launch.worker_failure`; resuming is suggested only when
a checkpoint exists to resume from). SIGTERM/SIGINT to this command reach every worker of the node,
which stop together after the checkpoint of their step; nothing of the job outlives this command
(:mod:`launch.supervise`). Framework noise is hidden in the workers too: they inherit the
environment :func:`conf.quiet.quiet_framework_logs` sets here.
Exit codes (:mod:`conf.exit_codes`): 0 done (a dry run always), 1 a worker failed, 2 configuration error
(also a busy ``launch.master_port``), 3 stopped by SIGTERM/SIGINT.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.checks import check_launch_config
from mindmoe.conf.exit_codes import CONFIG_ERRORS, reports_errors
from mindmoe.conf.moved_keys import exit_on_moved_keys
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs
from mindmoe.launch.config import validate_launch_config
from mindmoe.launch.msrun import (
    direct_workers,
    environment,
    is_local_address,
    log_dir,
    msrun_command,
    render,
)
from mindmoe.launch.scheduler import check_port_free
from mindmoe.launch.supervise import WorkerFailed, run_direct, run_msrun  # noqa: F401 (WorkerFailed: this command's)

register_configs()


def _device_target() -> str:
    """The device the workers will run on, for the checks that depend on it (bf16 and cell reuse on CPU)."""
    import mindspore as ms

    return ms.get_context("device_target")


def launch(cfg) -> int:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    overrides = list(hydra_cfg.overrides.task)
    validate_launch_config(cfg.launch)
    env = environment(cfg.launch)
    command = msrun_command(cfg.launch, run_dir, overrides)
    if cfg.launch.dry_run:
        # An operator reads the command of a node before the job is complete (batch sizes, a shared
        # run dir): print it, and what would stop the real launch as a warning.
        print(render(command, env, cfg.launch), flush=True)
        try:
            check_launch_config(cfg, list(hydra_cfg.overrides.hydra), overrides, _device_target(), hydra_cfg.runtime)
        except CONFIG_ERRORS as error:
            print(f"mindmoe-launch: warning: the launch would stop here: {error}", file=sys.stderr)
        return 0
    check_launch_config(cfg, list(hydra_cfg.overrides.hydra), overrides, _device_target(), hydra_cfg.runtime)
    hosts_scheduler = is_local_address(cfg.launch.master_addr)
    if hosts_scheduler and cfg.launch.node_rank == 0:
        # Before the data is prepared: a busy port would otherwise show only once msrun runs.
        check_port_free(cfg.launch.master_addr, cfg.launch.master_port)
    from mindmoe.data.prepare import prepare_data, with_pretrained_tokenizer

    prepared = prepare_data(with_pretrained_tokenizer(cfg.data, cfg.model.pretrained))
    print(f"data ready: {prepared.num_train_windows} training windows, tokenizer {prepared.tokenizer_path}", flush=True)
    logs = log_dir(cfg.launch, run_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if cfg.launch.node_rank > 0 and hosts_scheduler:
        return run_direct(direct_workers(cfg.launch, run_dir, overrides), env, run_dir)
    print(render(command, env, cfg.launch), flush=True)
    return run_msrun(command, env, cfg.launch, logs, run_dir)


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-launch")
def _main(cfg) -> None:
    sys.exit(launch(cfg))


def main() -> None:
    quiet_framework_logs()
    exit_on_moved_keys("mindmoe-launch", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()

"""``mindmoe-launch``: start this node's training workers with ``msrun``.

    mindmoe-launch launch.procs_per_node=8 train.max_steps=1000            # one node, 8 workers
    mindmoe-launch launch.dry_run=true launch.nodes=4 launch.procs_per_node=8 \\
        launch.node_rank=3 launch.master_addr=10.0.0.1 hydra.run.dir=/shared/run1

Takes the ``mindmoe-train`` config tree plus ``launch.*``. Before any worker starts it checks
that the world divides as configured and prepares the tokenizer and MindRecord shards (cached,
so the workers find them). Every worker gets the same overrides and the same run dir. When a
worker dies, msrun stops the others; this command then exits non-zero naming the failed rank's
log and quoting its first error line (:mod:`launch.worker_failure`; resuming is suggested only when
a checkpoint exists to resume from). Framework noise is hidden in the workers too: they inherit the
environment :func:`conf.quiet.quiet_framework_logs` sets here.
Exit codes (:mod:`conf.exit_codes`): 0 done (a dry run always), 1 a worker failed, 2 configuration error.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from mindmoe.conf.checks import check_launch_config
from mindmoe.conf.exit_codes import CONFIG_ERRORS, WORKER_FAILED, CommandExit, reports_errors
from mindmoe.conf.quiet import quiet_framework_logs
from mindmoe.conf.schema import register_configs
from mindmoe.launch.config import validate_launch_config
from mindmoe.launch.msrun import (
    direct_workers,
    environment,
    is_local_address,
    log_dir,
    msrun_command,
    process_environment,
    render,
)
from mindmoe.launch.worker_failure import FAILED_WORKER, failure_message

register_configs()


class WorkerFailed(CommandExit):
    """The job stopped because a worker exited with an error."""

    exit_code = WORKER_FAILED


def run_msrun(command, env, logs: Path, run_dir: Path) -> int:
    """Run msrun, echoing its output; on failure raise :class:`WorkerFailed` naming the rank's log."""
    process = subprocess.Popen(
        command,
        env=process_environment(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    first_failure = None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            found = FAILED_WORKER.search(line)
            if found and first_failure is None:
                first_failure = int(found.group(1)), int(found.group(2))
        code = process.wait()
    except KeyboardInterrupt:
        # msrun stops its workers and scheduler on SIGINT.
        process.send_signal(signal.SIGINT)
        process.wait()
        raise
    sys.stdout.flush()
    if code == 0:
        return 0
    if first_failure is not None:
        raise WorkerFailed(failure_message(logs, run_dir, *first_failure))
    raise WorkerFailed(f"msrun exited with code {code}; logs: {logs}")


def run_direct(workers, env, run_dir: Path) -> int:
    """Run this node's workers without msrun (see ``launch.msrun.direct_workers``) and watch them."""
    processes = []
    for worker in workers:
        worker["log"].parent.mkdir(parents=True, exist_ok=True)
        print(f"start worker rank {worker['rank']}, log file: {worker['log']}", flush=True)
        with open(worker["log"], "w", encoding="utf-8") as log_file:
            processes.append(
                subprocess.Popen(
                    worker["command"],
                    env=process_environment(dict(env, **worker["env"])),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(p, c) for p, c in zip(processes, codes) if c not in (None, 0)]
            if failed:
                for other in processes:
                    if other.poll() is None:
                        other.kill()
                process, code = failed[0]
                raise WorkerFailed(failure_message(workers[0]["log"].parent, run_dir, process.pid, code))
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


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
    from mindmoe.data.prepare import prepare_data, with_pretrained_tokenizer

    prepared = prepare_data(with_pretrained_tokenizer(cfg.data, cfg.model.pretrained))
    print(f"data ready: {prepared.num_train_windows} training windows, tokenizer {prepared.tokenizer_path}", flush=True)
    logs = log_dir(cfg.launch, run_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if cfg.launch.node_rank > 0 and is_local_address(cfg.launch.master_addr):
        return run_direct(direct_workers(cfg.launch, run_dir, overrides), env, run_dir)
    print(render(command, env, cfg.launch), flush=True)
    return run_msrun(command, env, logs, run_dir)


@hydra.main(config_path="pkg://mindmoe.conf", config_name="config", version_base="1.3")
@reports_errors("mindmoe-launch")
def _main(cfg) -> None:
    sys.exit(launch(cfg))


def main() -> None:
    quiet_framework_logs()
    _main()


if __name__ == "__main__":
    main()

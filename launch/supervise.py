"""Running this node's job until it ends, and ending all of it: echo msrun, watch workers, scheduler and signals.

The job ends in one of four ways, each raised here as one error for ``mindmoe-launch`` to report:

- done: msrun exits 0;
- a worker failed: msrun names its pid. msrun then kills the other workers but waits for the scheduler,
  which may wait ``launch.cluster_timeout`` for workers that never joined: the launcher ends the rest
  after :data:`FAILURE_GRACE_SECONDS` (exit 1, the rank's first error, :mod:`launch.worker_failure`);
- the scheduler could not listen on its port (``scheduler.log``): exit 2 naming ``launch.master_port``;
- SIGTERM/SIGINT to the launcher: forwarded to every worker, which stop together after rank 0's
  checkpoint of their step; after :data:`STOP_GRACE_SECONDS` or a second signal the rest is killed.
  Exit 3, as for one ``mindmoe-train`` process.

Whichever way, :meth:`launch.job.MsrunJob.kill` then ends msrun, the scheduler and every worker.
"""

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mindmoe.conf.exit_codes import CONFIG_ERROR, STOPPED_ON_SIGNAL, WORKER_FAILED, CommandExit
from mindmoe.launch.job import MsrunJob, send
from mindmoe.launch.msrun import process_environment
from mindmoe.launch.scheduler import SchedulerLog, bind_failure_message
from mindmoe.launch.worker_failure import FAILED_WORKER, failure_message, stop_message

#: Seconds the workers have, after a stop signal, to finish their step, write the checkpoint and exit.
STOP_GRACE_SECONDS = 600
#: Seconds after msrun reported a failed worker before the rest of the job is killed.
FAILURE_GRACE_SECONDS = 10
POLL_SECONDS = 0.5


class WorkerFailed(CommandExit):
    """The job stopped because a worker exited with an error."""

    exit_code = WORKER_FAILED


class SchedulerFailed(CommandExit):
    """msrun's scheduler could not listen on ``launch.master_port``."""

    exit_code = CONFIG_ERROR


class LaunchStopped(CommandExit):
    """A signal to the launcher stopped the job (after the workers' checkpoint, unless they were killed)."""

    exit_code = STOPPED_ON_SIGNAL
    label = "stopped"


class StopSignals:
    """Within its ``with`` block SIGTERM/SIGINT are only recorded, for the watch loop to act on."""

    def __init__(self):
        self.received = []
        #: Workers were still running when the grace time ran out or a second signal came: they were killed.
        self.killed = False
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name


def _announce(stop: StopSignals) -> None:
    print(
        f"mindmoe-launch: received {stop.name}: the workers stop after the checkpoint of their current step "
        f"(within {STOP_GRACE_SECONDS} s; send the signal again to kill them at once)",
        flush=True,
    )


def _reader(stream) -> queue.Queue:
    """The lines of ``stream``, read by a thread (the watch loop must not block on msrun's output); None at the end."""
    lines = queue.Queue()

    def read():
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


class _Watch:
    """What has been seen of one msrun run so far."""

    def __init__(self, job: MsrunJob, scheduler_log: Path):
        self.job = job
        self.scheduler_log = SchedulerLog(scheduler_log)
        self.first_failure = None
        self.bind_failure = None
        self.ended_output = False

    def echo(self, lines: queue.Queue, timeout: float) -> None:
        """Echo msrun's output for up to ``timeout`` seconds, noting its report of a failed worker."""
        deadline = time.monotonic() + timeout
        while not self.ended_output:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                self.ended_output = True
                break
            sys.stdout.write(line)
            found = FAILED_WORKER.search(line)
            if found and self.first_failure is None:
                self.first_failure = int(found.group(1)), int(found.group(2))
        sys.stdout.flush()

    def run(self, lines: queue.Queue, stop: StopSignals) -> None:
        """Watch until the job has ended or must be ended."""
        stop_deadline = failure_deadline = first_exit = None
        while True:
            self.echo(lines, POLL_SECONDS)
            now = time.monotonic()
            if self.ended_output and self.job.process.poll() is not None:
                return
            if stop.received:
                if stop_deadline is None:
                    stop_deadline = now + STOP_GRACE_SECONDS
                    # msrun would SIGKILL the other ranks as soon as the first one exits (with 3), maybe
                    # before they have said which checkpoint they wrote: it waits until they all have.
                    self.job.pause()
                    _announce(stop)
                self.job.forward(stop.received[0])
                running = self.job.running_workers()
                if not running:
                    return
                if len(running) < len(self.job.workers) and first_exit is None:
                    # The ranks leave together once the checkpoint is written; one that does not hangs.
                    first_exit = now
                    stop_deadline = min(stop_deadline, now + FAILURE_GRACE_SECONDS)
                if len(stop.received) > 1 or now > stop_deadline:
                    stop.killed = True
                    return
                continue
            self.bind_failure = self.scheduler_log.bind_failure()
            if self.bind_failure:
                return
            if self.first_failure is not None:
                failure_deadline = failure_deadline or now + FAILURE_GRACE_SECONDS
                if now > failure_deadline or not self.job.running_workers():
                    return


def run_msrun(command, env, launch, logs: Path, run_dir: Path) -> int:
    """Run msrun in a session of its own, echoing its output; end every process of the job before returning."""
    with StopSignals() as stop:
        process = subprocess.Popen(
            command,
            env=process_environment(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        job = MsrunJob(process)
        watch = _Watch(job, logs / "scheduler.log")
        lines = _reader(process.stdout)
        try:
            watch.run(lines, stop)
        finally:
            job.kill()
        # What msrun printed while it was ended (its output closes with the last log tail).
        watch.echo(lines, 2.0)
    if stop.received:
        raise LaunchStopped(stop_message(logs, stop.name, stop.killed))
    if watch.bind_failure:
        raise SchedulerFailed(
            bind_failure_message(launch.master_addr, launch.master_port, watch.bind_failure, logs / "scheduler.log")
        )
    if watch.first_failure is not None:
        raise WorkerFailed(failure_message(logs, run_dir, *watch.first_failure, node_timeout=launch.node_timeout))
    if process.returncode == 0:
        return 0
    raise WorkerFailed(f"msrun exited with code {process.returncode}; logs: {logs}")


def _watch_direct(processes, stop: StopSignals):
    """Watch workers started without msrun: ``(process, code)`` of the first that failed, else None.
    Sets ``stop.killed`` when workers had to be killed after a stop signal."""
    stop_deadline = None
    while True:
        codes = [p.poll() for p in processes]
        if stop.received:
            if stop_deadline is None:
                stop_deadline = time.monotonic() + STOP_GRACE_SECONDS
                _announce(stop)
                for process in processes:
                    if process.poll() is None:
                        process.send_signal(stop.received[0])
            if all(code is not None for code in codes):
                return None
            if len(stop.received) > 1 or time.monotonic() > stop_deadline:
                stop.killed = True
                return None
        else:
            failed = [(p, c) for p, c in zip(processes, codes) if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return None
        time.sleep(POLL_SECONDS)


def run_direct(workers, env, run_dir: Path) -> int:
    """Run this node's workers without msrun (see ``launch.msrun.direct_workers``) and watch them."""
    logs = workers[0]["log"].parent
    processes = []
    with StopSignals() as stop:
        try:
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
            failed = _watch_direct(processes, stop)
        finally:
            for process in processes:
                if process.poll() is None:
                    send(process.pid, signal.SIGKILL, group=True)
                process.wait()
    if stop.received:
        raise LaunchStopped(stop_message(logs, stop.name, stop.killed))
    if failed is not None:
        process, code = failed
        raise WorkerFailed(failure_message(logs, run_dir, process.pid, code))
    return 0

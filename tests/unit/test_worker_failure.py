"""What mindmoe-launch reports for a failed worker, from msrun's log dir: rank, log, the first error line,
and a resume hint only when a checkpoint exists and the worker did not reject its configuration."""

import pytest

from mindmoe.launch.msrun import WORKER_BANNER
from mindmoe.launch.worker_failure import FAILED_WORKER, failure_message, first_error_line, stop_message

IMPORT_FAILURE = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/site-packages/mindmoe/train/cli.py", line 12, in <module>
    import hydra
ModuleNotFoundError: No module named 'hydra'
"""
CONFIG_FAILURE = (
    "[2026-01-01 10:00:00,000][mindmoe.data.prepare][INFO] - data ready: 10 train windows\n"
    "[WARNING] ME(1:2,MainProcess):2026-01-01 [mindspore/x.py:1] some framework warning\n"
    "mindmoe-train: error: data.seq_len=64 exceeds the model's max_position_embeddings=32\n"
)


def write_logs(tmp_path, body_of_rank1):
    logs = tmp_path / "msrun"
    logs.mkdir()
    (logs / "worker_0.log").write_text(WORKER_BANNER.format(rank=0, pid=100) + "\nstill running\n")
    (logs / "worker_1.log").write_text(WORKER_BANNER.format(rank=1, pid=101) + "\n" + body_of_rank1)
    return logs


def test_msrun_failure_line_is_recognised():
    found = FAILED_WORKER.search("[ERROR] ME(7:8,MainProcess): Worker process 101 exit with exception. Error code: 2.")
    assert found and found.groups() == ("101", "2")


@pytest.mark.parametrize(
    "body, expected",
    [
        (IMPORT_FAILURE, "ModuleNotFoundError: No module named 'hydra'"),
        (CONFIG_FAILURE, "mindmoe-train: error: data.seq_len=64 exceeds the model's max_position_embeddings=32"),
        (
            "[ERROR] DISTRIBUTED(1,2):2026 [cluster.cc:10] Topology build timed out\nRuntimeError: x\n",
            "[ERROR] DISTRIBUTED(1,2):2026 [cluster.cc:10] Topology build timed out",
        ),
        ("nothing went wrong here\n", None),
    ],
)
def test_the_first_error_line_of_a_log(tmp_path, body, expected):
    log = tmp_path / "worker_0.log"
    log.write_text(body)
    assert first_error_line(log) == expected


def test_a_worker_that_died_at_start_is_quoted_and_gets_no_resume_hint(tmp_path):
    logs = write_logs(tmp_path, IMPORT_FAILURE)
    message = failure_message(logs, tmp_path, 101, 1)
    assert message.startswith(f"rank 1 (pid 101) exited with code 1; its log: {logs / 'worker_1.log'}")
    assert "its first error: ModuleNotFoundError: No module named 'hydra'" in message
    assert "train.resume" not in message and "continue from" not in message
    assert "No checkpoint was written" in message


def test_a_config_error_gets_no_resume_hint_even_beside_old_checkpoints(tmp_path):
    logs = write_logs(tmp_path, CONFIG_FAILURE)
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    message = failure_message(logs, tmp_path, 101, 2)
    assert "its first error: mindmoe-train: error: data.seq_len=64 exceeds" in message
    assert "train.resume" not in message and "rejected its configuration" in message


def test_a_worker_that_failed_after_a_checkpoint_gets_the_resume_hint(tmp_path):
    logs = write_logs(tmp_path, "step 5\n")
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    message = failure_message(logs, tmp_path, 101, -9)
    assert "rank 1 (pid 101) exited with code -9" in message and "its first error" not in message
    assert f"continue from the last checkpoint in {tmp_path / 'checkpoints'} (train.resume=auto)" in message


def test_a_half_written_checkpoint_is_not_one_to_resume_from(tmp_path):
    logs = write_logs(tmp_path, IMPORT_FAILURE)
    (tmp_path / "checkpoints" / ".step_000004.tmp-77").mkdir(parents=True)
    assert "train.resume" not in failure_message(logs, tmp_path, 101, 1)


STOPPED = "mindmoe-train: stopped: received SIGTERM: checkpoint of step 7 written to /run/checkpoints/step_000007"


def test_a_stop_quotes_the_lowest_rank_that_said_which_checkpoint_it_wrote(tmp_path):
    logs = write_logs(tmp_path, "step 7\n" + STOPPED + "\n")
    (logs / "worker_10.log").write_text(STOPPED.replace("SIGTERM", "a stop signal on another rank") + "\n")
    message = stop_message(logs, "SIGINT", killed=False)
    assert message.startswith(f"received SIGINT; rank 1 reported: {STOPPED[len('mindmoe-train: stopped: ') :]}")
    assert "killed" not in message


def test_a_stop_before_any_checkpoint_says_so_and_that_late_workers_were_killed(tmp_path):
    logs = write_logs(tmp_path, "compiling\n")
    message = stop_message(logs, "SIGTERM", killed=True)
    assert "the workers stopped before writing a checkpoint of this run" in message and str(logs) in message
    assert "workers still running after that were killed" in message


# What the MindSpore 2.9 scheduler logged when rank 1 was stopped (SIGSTOP) for longer than MS_NODE_TIMEOUT=5;
# MindSpore then ended the other worker with SIGTERM, and msrun reported that one.
SCHEDULER_TIMED_OUT = (
    "[ERROR] DISTRIBUTED(6617,7fada5c876c0,python):2026-12-03-18:49:22.008.778 [mindspore/ccsrc/cluster/topology/"
    "meta_server_node.cc:548] UpdateTopoState] The node: 1 is timed out. It may exit with exception, please check "
    "this node's log.\n"
    "RuntimeError: The total number of timed out node is 1. Timed out node list is: [const vector]{1}, worker 1 is "
    "the first one timed out, please check its log.\n"
)


def test_a_worker_the_scheduler_stopped_hearing_from_is_named_with_the_timeout_to_raise(tmp_path):
    logs = write_logs(tmp_path, "")
    (logs / "scheduler.log").write_text(SCHEDULER_TIMED_OUT)
    message = failure_message(logs, tmp_path, 100, -15, node_timeout=30)
    assert message.startswith("rank 0 (pid 100) exited with code -15")
    assert "rank 1 did not answer for launch.node_timeout (30 s, MS_NODE_TIMEOUT" in message
    assert str(logs / "worker_1.log") in message and "a larger launch.node_timeout" in message


def test_no_timeout_is_reported_when_the_scheduler_saw_none(tmp_path):
    logs = write_logs(tmp_path, IMPORT_FAILURE)
    (logs / "scheduler.log").write_text("[WARNING] DISTRIBUTED(1,2): Topology build timed out., retry(1/1200).\n")
    assert "node_timeout" not in failure_message(logs, tmp_path, 101, 1, node_timeout=30)

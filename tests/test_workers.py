"""kdacp.workers.launch: ``prepare`` before the group, the world-size refusal, the deadline over start-up,
a rank that dies after its result, and no process left behind after a signal or a killed launcher, also one
killed while its workers are still starting."""
import atexit
import functools
import logging
import os
import signal
import subprocess
import sys
import time

# A worker of test_a_launcher_killed_while_its_workers_start_leaves_none imports this module while it starts
# (its function is pickled by reference): a start-up that takes long, as on a loaded machine.
if os.environ.get("KDACP_TEST_SLOW_START") and "--multiprocessing-fork" in sys.argv:
    time.sleep(float(os.environ["KDACP_TEST_SLOW_START"]))

import pytest
import torch.distributed as dist

from kdacp import workers
from kdacp.workers import Stopped, WorkerError, configure_logging, launch

_BEFORE_GROUP = []  # filled in each rank's own process by _prepare


def _prepare():
    _BEFORE_GROUP.append(not dist.is_initialized())


def _rank(worker):
    return worker.rank, os.getpid(), list(_BEFORE_GROUP)


def _sleep(worker, seconds=120.0):
    time.sleep(seconds)


def _abort_at_exit(worker):
    """Returns its result, then the process aborts at exit (as gloo's teardown once did)."""
    if worker.rank == 1:
        atexit.register(os.kill, os.getpid(), signal.SIGABRT)
    return worker.rank


def test_prepare_runs_in_each_rank_before_its_group():
    results = launch(_rank, 2, prepare=_prepare, timeout_s=120)
    assert [r[0] for r in results] == [0, 1]
    assert results[0][1] != results[1][1] != os.getpid()  # each rank's own process
    assert [r[2] for r in results] == [[True], [True]]
    assert _BEFORE_GROUP == []  # not in the launching process
    # without it nothing runs
    assert [r[2] for r in launch(_rank, 2, timeout_s=120)] == [[], []]


def _fail_the_first_start(marker):
    """``prepare``: on the first start's port (the first one written to ``marker``) the group fails to form as
    gloo's does when its loopback connections drop."""
    port = os.environ["MASTER_PORT"]
    if not os.path.exists(marker):  # both ranks of the first start may write it: the same port
        with open(f"{marker}.{os.getpid()}", "w") as f:
            f.write(port)
        os.replace(f"{marker}.{os.getpid()}", marker)
    with open(marker) as f:
        if f.read() == port:
            def refuse(*args, **kwargs):
                raise RuntimeError("Gloo connectFullMesh failed with [pair.cc] Connection closed by peer (a test)")
            dist.init_process_group = refuse


def _port(worker):
    return int(os.environ["MASTER_PORT"])


def test_a_group_that_fails_to_form_starts_once_more_on_another_port(tmp_path):
    marker = str(tmp_path / "first")
    ports = launch(_port, 2, prepare=functools.partial(_fail_the_first_start, marker), timeout_s=120)
    with open(marker) as f:
        first = int(f.read())
    assert ports[0] == ports[1] != first
    # on a port the caller chose the failure is the run's, named
    with pytest.raises(WorkerError, match=r"process group did not form: RuntimeError: Gloo connectFullMesh failed"):
        launch(_port, 2, port=workers.free_port(), prepare=functools.partial(_fail_the_first_start, f"{marker}2"),
               timeout_s=120)


def test_one_rank_runs_in_this_process_with_its_group_and_deadline(no_spawn):
    _BEFORE_GROUP.clear()
    reports = []

    def one(worker):
        worker.report("hello")
        return worker.rank, os.getpid(), list(_BEFORE_GROUP), dist.get_world_size()
    try:
        assert launch(one, 1, prepare=_prepare, on_report=lambda r, m: reports.append((r, m))) == [
            (0, os.getpid(), [True], 1)]
    finally:
        _BEFORE_GROUP.clear()
    assert reports == [(0, "hello")] and not dist.is_initialized()  # the group is gone afterwards
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"passed its 1 s limit and was stopped"):
        launch(_sleep, 1, timeout_s=1.0)
    assert time.monotonic() - start < 2.5 and not dist.is_initialized()


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails a test that gets as far as creating a worker process."""
    def get_context(*args):
        raise AssertionError("a worker was about to start")
    monkeypatch.setattr(workers.mp, "get_context", get_context)


def test_world_size_beyond_the_cores_is_refused_before_any_worker(no_spawn, monkeypatch):
    monkeypatch.setattr(workers, "_cores", lambda: 2)
    monkeypatch.setattr(workers, "_available_mb", lambda: 1e9)
    launch_ok = 2 * workers.RANKS_PER_CORE
    with pytest.raises(WorkerError, match=rf"--world-size {launch_ok + 1} is more than this machine holds: 2 cores "
                                          rf"hold at most {launch_ok} CPU ranks .* lower --world-size to {launch_ok}"):
        launch(_rank, launch_ok + 1)
    workers.check_world_size(launch_ok, "cpu")


def test_world_size_beyond_the_memory_is_refused_before_any_worker(no_spawn, monkeypatch):
    monkeypatch.setattr(workers, "_cores", lambda: 64)
    monkeypatch.setattr(workers, "_available_mb", lambda: 3.5 * workers.RANK_MEMORY_MB)
    with pytest.raises(WorkerError, match=rf"GB of available memory at most 3 \({workers.RANK_MEMORY_MB} MB per "
                                          r"rank\); lower --world-size to 3 or less"):
        launch(_rank, 4)


def test_world_size_1024_is_refused_here(no_spawn):
    """The machine at hand, measured: the issue's 1024 workers filled 23 GB on 2 cores."""
    start = time.monotonic()
    with pytest.raises(WorkerError, match="is more than this machine holds"):
        launch(_rank, 1024)
    assert time.monotonic() - start < 1


def test_deadline_counts_the_start_up(monkeypatch):
    real = workers._start

    def slow_start(process):
        time.sleep(0.7)
        real(process)
    monkeypatch.setattr(workers, "_start", slow_start)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"passed its 1 s limit while starting its workers \(2 of 3 started\)"):
        launch(_sleep, 3, timeout_s=1.0)
    assert time.monotonic() - start < 2.5


def test_a_rank_that_dies_after_its_result_fails_the_run():
    with pytest.raises(WorkerError, match=r"worker rank 1 died after returning its result \(signal SIGABRT\)"):
        launch(_abort_at_exit, 2, timeout_s=120)


# The launcher of the signal tests: `kdacp demo`'s own code path, its rank function a sleep (as a training
# run that takes long) and no transformers import, so that each test takes seconds.
_LAUNCHER = """
import sys, kdacp.demo, kdacp.integrations.transformers, tests.test_workers as t
kdacp.demo.demo_worker, kdacp.integrations.transformers.load_kimi_linear = t._sleep_ranks, t._no_prepare
from kdacp.cli import main
sys.exit(main(["demo", "--world-size", "2", "--seq-lens", "64,64", "--timeout", "120"]))
"""


def _no_prepare():
    pass


def _sleep_ranks(worker, cfg):
    open(os.path.join(os.environ["KDACP_TEST_DIR"], f"rank{worker.rank}"), "w").close()
    time.sleep(120)


def _processes_of(pid: int) -> list[int]:
    """``pid``'s children: its workers and multiprocessing's resource tracker."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except OSError:
        return False


def _start_launcher(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """The launcher as the leader of a new process group (as a shell's foreground job), once both ranks are inside
    their function; returns it and its child processes. Its output goes to files: workers left behind
    would hold pipes open."""
    env = dict(os.environ, KDACP_TEST_DIR=str(tmp_path))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=out, stderr=err, text=True, env=env,
                                preexec_fn=os.setsid)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
        assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the ranks did not start")
        time.sleep(0.2)
    return proc, _processes_of(proc.pid)


def _stop_and_check(proc: subprocess.Popen, children: list[int], within_s: float = 5.0) -> None:
    """Wait for the launcher, then assert that none of ``children`` runs ``within_s`` later; kills what is
    left either way, so that a failing test leaves no process behind."""
    try:
        proc.wait(timeout=30)
        deadline = time.monotonic() + within_s
        while any(_running(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in children if _running(p)]
        assert not alive, f"left running {within_s:.0f} s later: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for p in children:
            if _running(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_a_signal_stops_every_process_with_one_line(tmp_path, signum):
    proc, children = _start_launcher(tmp_path)
    assert len(children) == 3, children  # 2 workers and the resource tracker
    # SIGINT and SIGHUP as a terminal sends them, to the whole process group; SIGTERM as kill does
    (os.killpg if signum != signal.SIGTERM else os.kill)(proc.pid, signum)
    _stop_and_check(proc, children)
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 128 + signum, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and "demo: 2 ranks" not in ln]  # not the progress bar
    assert lines == [f"kdacp demo: stopped by {signal.Signals(signum).name}; every worker was stopped"], err[-3000:]


def test_a_killed_launcher_leaves_no_worker(tmp_path):
    proc, children = _start_launcher(tmp_path)
    assert len(children) == 3, children
    proc.kill()
    _stop_and_check(proc, children)


_SLOW_START_LAUNCHER = """
import tests.test_workers as t
from kdacp.workers import launch
launch(t._rank, 2, timeout_s=120)
"""


def test_a_launcher_killed_while_its_workers_start_leaves_none(tmp_path):
    env = dict(os.environ, KDACP_TEST_SLOW_START="40")
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_START_LAUNCHER], stdout=out, stderr=out, env=env)
    deadline = time.monotonic() + 60
    while len(children := _processes_of(proc.pid)) < 3:  # 2 workers and the resource tracker
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # the workers are importing, far from their function
    proc.kill()
    _stop_and_check(proc, children)


def test_stopped_names_the_signal():
    assert str(Stopped(signal.SIGTERM)) == "stopped by SIGTERM; every worker was stopped"
    assert isinstance(Stopped(signal.SIGINT), WorkerError)


def _log_info(worker):
    logging.getLogger("kdacp.test_workers").info(f"rank {worker.rank} logs")
    return worker.rank


def test_workers_log_at_the_launchers_level(capfd):
    """``kdacp -v`` reaches the workers: each logs through the ``kdacp`` logger at the launcher's level."""
    logger = logging.getLogger("kdacp")
    level, handlers = logger.level, list(logger.handlers)
    configure_logging(logging.INFO)
    try:
        assert launch(_log_info, 2, timeout_s=120) == [0, 1]
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers
    assert "rank 1 logs" in capfd.readouterr().err

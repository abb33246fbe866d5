import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings

# CI explores a fixed set of examples (a red CI must be reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("sanitize", derandomize=True, print_blob=True, max_examples=60)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

# litellm fetches a price list from the internet at import unless told not to (no network here).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# The commands the tests run print errors in typer's panels, which wrap at 80 columns without a
# terminal: a temporary path in a message (longer under a pytest-xdist worker's folder) would be cut.
os.environ.setdefault("COLUMNS", "250")
# Every vLLM server the suite starts reserves this much KV cache (GiB; agentaccel's own default for
# CPU is 2): the bench's five servers and the other worker's start at once, and vLLM refuses to
# start when the node's free memory is below what it reserves (1 GiB holds 23,000 tokens of
# SmolLM2, past every test's max_model_len times its requests in flight).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Two workers on two cores: a torch that spreads each product over both (its default) spins for
# the core the other worker holds (the embedded model's tests ran 4-9 times slower than alone).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


import pytest  # noqa: E402
from leftovers import check, mark_session  # noqa: E402
from vllm_memory import VllmMemory  # noqa: E402

_SESSION = {"mark": mark_session(), "temp": []}  # before any test starts a process
_VLLM_MEMORY = VllmMemory()  # this worker's hold on the workers' vLLM memory lock


@pytest.fixture(scope="session", autouse=True)
def _run_temp_folder(tmp_path_factory):
    """The run's temporary folder, for the session-end check."""
    _SESSION["temp"].append(tmp_path_factory.getbasetemp())


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: a module's servers start in its first test's setup
def pytest_runtest_setup(item):
    """The hold on the workers' vLLM memory lock this test's module asks for (`vllm_servers`:
    tests/vllm_memory.py): taken, kept or given up here, by then the last module's servers stopped."""
    mark = item.get_closest_marker("vllm_servers")
    _VLLM_MEMORY.want(mark.args[0] if mark else None, item.config._tmp_path_factory.getbasetemp())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The suite runs on two pytest-xdist workers (pyproject's addopts, `--dist loadgroup`); a
    module's tests stay together on one worker (its module-scoped servers start once), and a
    module that names a group (`pytestmark = pytest.mark.xdist_group(...)`) shares a worker with
    the group's other modules: those that start several vLLM servers at once (memory), or share
    a session-scoped environment (OpenHands, the agent CLIs)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    # the longest groups first (each worker takes the next group when it is done): none is left to
    # start on one worker while the other has nothing left (their minutes: docs/DEVELOPING.md)
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(_group(item), len(first)))


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


# the groups that take longest, longest first (a run's --durations=0 output, summed by module),
# except that the modules starting one vLLM server wait until the other worker's `vllm-many` is
# about done (tests/vllm_memory.py): meanwhile that worker runs the long groups that start none
LONGEST_FIRST = ("vllm-many", "test_openhands", "test_local_backend", "test_stage_discovery", "test_first_hour",
                 "test_wheel_install", "test_vllm_backend", "test_no_record", "test_fleet_reliability",
                 "test_proxy_local", "test_replay_every_format", "test_agent_clients", "test_bench_agent",
                 "test_shared_store", "test_cli", "test_vllm_tenants", "test_tenants", "test_bad_input_suite",
                 "test_prefix_cache", "test_model_drafter")


def pytest_sessionfinish(session, exitstatus):
    """Fails the run, naming them, when processes it started are still alive (and kills them),
    or when pytest itself still listens on a port (tests/leftovers.py). Under pytest-xdist each
    worker checks what it started; the controller, which runs no test, checks nothing."""
    _VLLM_MEMORY.release()
    if getattr(session.config, "workerinput", None) is None and session.config.getoption("numprocesses", None):
        return
    problems = check(_SESSION["mark"], _SESSION["temp"])
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in problems:
            (reporter.write_line if reporter else print)(f"LEFTOVER: {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _openhands_environment(tmp_path_factory, folder: str, what: str, *generation):
    """One OpenHands generation's own environment (Python >= 3.12, built with uv in a temporary
    folder), shared by the tests that run it; they are skipped where none can be built."""
    from agentaccel.adapters import openhands_env

    python, why = openhands_env.build(tmp_path_factory.mktemp(folder), *generation)
    if python is None:
        pytest.skip(f"no environment for {what}: {why}")
    return python


@pytest.fixture(scope="session")
def openhands_python(tmp_path_factory):
    """The OpenHands SDK (1.58)."""
    return _openhands_environment(tmp_path_factory, "openhands-env", "the OpenHands SDK")


@pytest.fixture(scope="session")
def classic_python(tmp_path_factory):
    """The classic OpenHands core (openhands-ai 0.62)."""
    from agentaccel.adapters import openhands_env

    return _openhands_environment(tmp_path_factory, "openhands-classic", "the classic OpenHands core",
                                  openhands_env.CLASSIC, openhands_env.CLASSIC_MODULES)


@pytest.fixture(scope="session")
def app_python(tmp_path_factory):
    """The 1.x OpenHands app (openhands-ai 1.11, a web app)."""
    from agentaccel.adapters import openhands_env

    return _openhands_environment(tmp_path_factory, "openhands-app", "the OpenHands app",
                                  openhands_env.APP, openhands_env.APP_MODULES)


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A real PostgreSQL server for the run (tests/postgres_server.py); the tests that need it fail,
    saying how to install PostgreSQL, when none can be started."""
    from postgres_server import PostgresServer

    # not under pytest's own folder: that is private to the user running the tests, and the server
    # runs as another when that user is root
    folder = Path(tempfile.mkdtemp(prefix="agentaccel-postgres-"))
    _SESSION["temp"].append(folder)
    server = PostgresServer(folder / "server")
    try:
        server.start()
    except RuntimeError as e:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(str(e), pytrace=False)
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def new_store(request, tmp_path):
    """Makes fresh, empty trace stores on each backend in turn: a SQLite file in the test's folder,
    or a new database on the run's PostgreSQL server. Returns what `--db` takes (a path or a URL)."""
    if request.param == "sqlite":
        count = iter(range(1_000_000))
        return lambda: tmp_path / f"store{next(count)}.db"
    return request.getfixturevalue("postgres").new_database


@pytest.fixture
def db(new_store):
    """One fresh trace store, on each backend in turn."""
    return new_store()

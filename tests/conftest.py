import os
import random
import warnings
import zlib

import pytest
import torch


def pytest_configure(config):
    # One base seed per run, in the environment so pytest-xdist's workers share it; each test
    # seeds Python's and torch's global generators from it and its own id (below), so a failure's
    # random draws replay with MPK_TEST_SEED=<the seed its report names>, in any order or worker.
    os.environ.setdefault("MPK_TEST_SEED", str(random.SystemRandom().randrange(1 << 31)))
    # Under pytest-xdist each worker takes its share of the cores, and so do the processes it
    # starts: torch's threads of several processes on the same cores only wait on each other.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def pytest_terminal_summary(terminalreporter):
    # at the end, where `pytest -q` shows it too (it hides the header)
    terminalreporter.write_line(f"mpk test seed: MPK_TEST_SEED={os.environ['MPK_TEST_SEED']}")


def _test_seed(nodeid: str) -> int:
    return zlib.crc32(f"{os.environ['MPK_TEST_SEED']}:{nodeid}".encode())


@pytest.fixture(autouse=True)
def _seeded(request):
    seed = _test_seed(request.node.nodeid)
    random.seed(seed)
    torch.manual_seed(seed)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("mpk test seed", f"MPK_TEST_SEED={os.environ['MPK_TEST_SEED']} replays this test's "
                                                 "random draws"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield

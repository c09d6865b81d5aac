"""Session-wide test settings: hypothesis profiles, a private cache of compiled pipelines."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from hypothesis import settings

# ``ci`` (make test): fewer examples for property tests that do not ask for their own count (tests/_profile.py sizes
# the costly ones); ``long`` (make test-long, nightly): hypothesis's full default. Chosen by $HYPOTHESIS_PROFILE.
settings.register_profile("ci", max_examples=50, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal gives it, however the suite was started.

    A shell starts a background job (``make test &``, ``nohup``, a script's ``&``) with SIGINT ignored; Python then
    keeps it ignored and every process the tests start inherits that, so the tests that send SIGINT to a loader (a
    child, or this process) would see it do nothing. Python's own handler here: a child gets the default action back
    at ``exec`` and installs its ``KeyboardInterrupt``, as in a terminal.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _the_threading_layer_a_loader_chooses() -> None:
    """Each test process starts Numba's threading layer as a Loader does (``prefer_tbb``: TBB), before any test.

    Otherwise the first parallel kernel a test calls outside a Loader chooses it, Numba's way (GNU OpenMP, with
    TBB not on its path), and a later test that forks in that worker fails in the child ("fork() called from a
    process already using GNU OpenMP"): which test failed depended on the order xdist gave the worker.
    """
    from stoker.pipeline.threads import prefer_tbb

    prefer_tbb()


#: settings the whole suite runs with (tests that are about them set them back for their own processes):
#: - ``STOKER_COMPILED_EPOCH=0`` (``make test``): epochs are made by producers calling each pipeline's fused
#:   functions from Python, the path of a fresh process's first epoch, rather than by the producer loop compiled for
#:   each pipeline, which was most of the suite's compile time (a full run 5:17 instead of 12:35-14:50 on 2 cores).
#:   The compiled loop is tested by the tests marked ``compiled_loop`` (its engine, hand-over, switch, Ctrl-C and
#:   the switch's hypothesis test that it gives the Python producers' batches bit for bit); ``make test-long`` runs
#:   every test on it (``STOKER_SUITE_COMPILED_LOOP=1``);
#: - ``STOKER_COMPILE_IN_BACKGROUND=0``: loaders compile their producer loop before the first batch, as the engine's
#:   tests expect of epoch 0 (by default a loader whose loop is not cached makes its first epoch with Python producers
#:   while the loop compiles in the background: tests/loader/test_cold_start.py);
#: - ``STOKER_HOST_KERNELS=0``: prebuilt kernels a test loads are not compiled again for this CPU in a background
#:   process (each test process would start one, competing with the suite for its two cores;
#:   tests/pipeline/test_prebuilt_files.py turns it on).
SUITE_ENVIRONMENT = {"STOKER_COMPILE_IN_BACKGROUND": "0", "STOKER_HOST_KERNELS": "0"}
if os.environ.get("STOKER_SUITE_COMPILED_LOOP", "0") != "1":
    SUITE_ENVIRONMENT["STOKER_COMPILED_EPOCH"] = "0"


@pytest.fixture(autouse=True)
def _compiled_loop_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``compiled_loop`` runs its loaders' epochs on the compiled producer loop (as users' processes do
    once it is compiled), its child processes too."""
    if request.node.get_closest_marker("compiled_loop") is not None:
        monkeypatch.setenv("STOKER_COMPILED_EPOCH", "1")


@pytest.fixture(autouse=True, scope="session")
def _suite_environment() -> Iterator[None]:
    """:data:`SUITE_ENVIRONMENT` for the session, the previous values back after it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in SUITE_ENVIRONMENT.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(autouse=True, scope="session")
def _private_fused_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fused pipelines compiled by the tests are cached in a temporary folder, not in ~/.cache.

    Under pytest-xdist the workers of one run share it (the run's temporary root, private to this user): a
    pipeline one worker compiled, the others load. Stoker's cache is made for several processes at once
    (files written whole and renamed, Numba's index likewise).
    """
    old = os.environ.get("STOKER_CACHE_DIR")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "stoker-cache"
        folder.mkdir(mode=0o700, exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("stoker-cache")
    os.environ["STOKER_CACHE_DIR"] = str(folder)
    # the library's kernels too, and for the child processes that tests start with a cache root of their own (they
    # depend only on stoker's sources: compiled once per run; a test about the kernels' own caching removes it)
    old_kernels = os.environ.get("STOKER_CACHE_KERNELS_DIR")
    os.environ["STOKER_CACHE_KERNELS_DIR"] = str(folder)
    yield
    for name, value in (("STOKER_CACHE_DIR", old), ("STOKER_CACHE_KERNELS_DIR", old_kernels)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

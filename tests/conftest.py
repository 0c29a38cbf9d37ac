"""Shared pytest set-up: GPU marker skipping, a quiet log, and the fixtures every room uses."""
from __future__ import annotations

import os

import pytest

from tools.blas_threads import default_to_one_blas_thread

os.environ.setdefault("COLI_LOG", "off")
# as every coli-kv process does (tools/blas_threads.py), and before pytest-xdist starts its workers, which
# inherit it: two workers' BLAS pools spinning on two cores slowed numpy-heavy tests 2.7x on a busy machine
default_to_one_blas_thread()


def _cuda_device_usable() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime

        return runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or CUDARuntimeError: no device
        return False


# Modules that take a minute or more: handed to the two workers first (pytest-xdist's loadfile takes modules
# in collection order), so neither is left running one of them alone at the end of the run.
LONG_MODULES = ("tests/service/test_service_kill_soak.py", "tests/kvfile/test_crash_states.py",
                "tests/sessions/test_crash_states.py", "tests/kernels/test_fp8_exhaustive.py",
                "tests/service/test_service_chunked_prefill.py", "tests/kvfile/test_crash_sigkill.py")


def pytest_sessionstart(session: pytest.Session) -> None:
    """In pytest's main process, before pytest-xdist starts its workers (its own hook runs last):
    numba's cache filled once (tests/support/warm_kernels.py), not by every worker at once."""
    if hasattr(session.config, "workerinput"):  # a worker: the main process has warmed the cache
        return
    from tests.support.warm_kernels import warm_if_cold

    warm_if_cold()


def _long_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONG_MODULES.index(path) if path in LONG_MODULES else len(LONG_MODULES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_long_first)  # stable: every module's tests stay together and in order
    if _cuda_device_usable():
        return
    skip_gpu = pytest.mark.skip(reason="no usable CUDA device (cupy absent or no GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def tiny():  # an MLADecoder
    """The embedded tiny model (random weights, byte vocabulary), loaded once per test module."""
    from kernels.model import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_glm_dir(tmp_path_factory: pytest.TempPathFactory):  # a pathlib.Path
    """A tiny random glm_moe_dsa checkpoint directory (DSA indexer, shared layers), written with numpy."""
    from kernels.model.tiny_glm import write_tiny_glm

    return write_tiny_glm(tmp_path_factory.mktemp("tiny-glm"))


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):  # a tests.support.seaweed.SeaweedS3
    """ONE SeaweedFS (a real S3 server, tools/_seaweed.py) for the whole run, on loopback, in a temporary directory,
    stopped and removed at the end. Its binary comes with the test extra: missing, the tests that
    need it fail with how to install it."""
    from tools._seaweed import SeaweedMissing, start_seaweed

    try:
        server = start_seaweed(tmp_path_factory.mktemp("seaweedfs"))
    except SeaweedMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweed_buckets(seaweed):  # a tests.support.seaweed.BucketPool
    from tests.support.seaweed import BucketPool

    return BucketPool(seaweed)


_seaweed_clients: list[object] = []  # the s3fs instances the last s3_bucket test left cached


@pytest.fixture
def s3_bucket(seaweed, seaweed_buckets, monkeypatch: pytest.MonkeyPatch):
    """A fresh, empty bucket on the run's SeaweedFS for this test (a tests.support.seaweed.Bucket);
    the AWS environment points at the server while the test runs, for s3fs here and the processes
    the test starts.

    s3fs caches its instances by their arguments, not by the environment, so a test that changes
    the AWS environment clears them. Here the environment is the same for every test: the instances
    the previous s3_bucket test left are kept when nothing else ran, created or cleared any since
    (a new client costs ~0.1-0.25 s; one per test was a third of these tests' time)."""
    import s3fs

    from tests.support.seaweed import Bucket
    from tools._seaweed import client_env

    for name, value in client_env(seaweed.endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    cached = list(s3fs.S3FileSystem._cache.values())
    if not cached or [id(fs) for fs in cached] != [id(fs) for fs in _seaweed_clients]:
        s3fs.S3FileSystem.clear_instance_cache()
    yield Bucket(seaweed_buckets.take(), seaweed.endpoint)
    _seaweed_clients[:] = list(s3fs.S3FileSystem._cache.values())

"""The test run's one switch. `python -m pytest -q` is the quick run: every claim proved once (each block
against its independent formulation, naive vs absorbed MLA, speculative == plain decoding, alone == batch for
greedy and seeded sampling, the FP8 cache, the loader, a sample of the fault messages), within a minute on a
2-core CPU. `python -m pytest -q --full` runs every test (CI: .ci/run): also those marked `full`, which repeat
a claim the quick run proves (other settings, more fault cases) or are slow; a test named on the command line
(test_nano.py::test_...) runs either way. GPU tests skip without CUDA."""

import os

import torch

if not torch.cuda.is_available():  # small tensors: a second thread costs more than it saves (2-25x)
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the whole suite (tests marked `full` too)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full: runs with --full only (the quick run proves its claim, or it is slow)"
    )


def pytest_collection_modifyitems(config, items):
    """Without --full, deselect the tests marked `full`, but those named on the command line (file::test)."""
    if config.getoption("--full"):
        return
    named = [arg.split("::", 1) for arg in config.args if "::" in arg]
    named = [os.path.relpath(os.path.abspath(path), config.rootpath) + "::" + test for path, test in named]
    keep = {i for i in items if not i.get_closest_marker("full") or i.nodeid.startswith(tuple(named))}
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = [i for i in items if i in keep]

"""The thread-count workers behind tests.helpers.invariance.run_with_threads compute what a fresh
interpreter at that thread count computes: the thread count, a namespace of its own per snippet
(and torch's global RNG seeded to 0 for each), and a failing snippet's traceback."""

import pytest
import torch

from tests.helpers.invariance import run_with_threads

pytestmark = [pytest.mark.multiprocess, pytest.mark.threads]

PROBE = "result = (torch.get_num_threads(), torch.randn(4), 'leftover' in globals())"


@pytest.mark.parametrize("threads", [1, 3])
def test_a_worker_snippet_equals_a_fresh_interpreters(threads):
    run_with_threads(
        "leftover = torch.manual_seed(5); torch.set_num_threads(2); result = 0", threads
    )
    kept, fresh = run_with_threads(PROBE, threads), run_with_threads(PROBE, threads, fresh=True)
    assert kept[0] == fresh[0] == threads
    assert kept[1].equal(torch.randn(4, generator=torch.Generator().manual_seed(0)))
    assert kept[2] is fresh[2] is False


def test_a_failing_snippet_raises_with_its_traceback_and_the_worker_goes_on():
    with pytest.raises(RuntimeError, match=r"(?s)2 threads failed.*ZeroDivisionError"):
        run_with_threads("result = 1 / 0", 2)
    assert run_with_threads("result = 7", 2) == 7

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone (world 1), destroyed after the test: a ShardGroup
    needs torch.distributed initialised, and a world of one runs in-process in milliseconds."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this test process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

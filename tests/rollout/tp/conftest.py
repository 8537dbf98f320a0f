import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """torch.distributed with a default group of this process alone (world 1): a ShardGroup
    needs it, and a world of one runs in-process in milliseconds. An in-process DeepSpeed
    worker of an earlier test (same pytest worker) may have left one: it is used as it is."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                f"torch.distributed is initialised with world size {dist.get_world_size()} in "
                "this test process; these tests need a world of one"
            )
        yield
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

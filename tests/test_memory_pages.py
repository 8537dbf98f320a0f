"""`release_pages` (rl_engine/base/memory_pages.py) on real mappings: an anonymous tensor's released
pages read zeros, a private file mapping's read the file again; its ends keep their bytes;
and an engine refuses to release a tensor its syncs would not rewrite whole."""

from __future__ import annotations

import pytest
import torch

from rl_engine.base.memory_pages import anonymous_private, page_size, release_pages


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_anonymous_pages_read_zeros_after_release():
    tensor = torch.full((16 << 20,), 7, dtype=torch.uint8)  # 16 MiB: its own mapping
    assert anonymous_private(tensor)
    before = _resident_kib()
    released = release_pages(tensor, "tensor")
    assert released >= tensor.numel() - 2 * page_size()
    assert before - _resident_kib() > (released >> 10) // 2
    head = -tensor.data_ptr() % page_size()  # bytes before the first whole page
    assert torch.equal(tensor[:head], torch.full((head,), 7, dtype=torch.uint8))
    inner = tensor[head : head + released]
    assert int(inner.count_nonzero()) == 0
    assert int(tensor[head + released :].count_nonzero()) == tensor.numel() - head - released
    tensor.fill_(3)  # the tensor stays usable: fresh pages
    assert int((tensor == 3).sum()) == tensor.numel()


def test_private_file_pages_read_the_file_after_release(tmp_path):
    path = tmp_path / "weights.bin"
    torch.arange(1 << 20, dtype=torch.int32).numpy().tofile(path)
    tensor = torch.from_file(str(path), shared=False, size=1 << 20, dtype=torch.int32)
    expected = torch.arange(1 << 20, dtype=torch.int32)
    tensor.zero_()  # private copies of the file's pages
    assert not anonymous_private(tensor)
    assert not torch.equal(tensor, expected)  # negative control: the copy differs now
    assert release_pages(tensor, "weights.bin") > 0
    assert torch.equal(tensor, expected)


def test_engine_refuses_to_release_a_tensor_a_sync_writes_in_part():
    from rl_engine.models import load_model
    from rl_engine.rollout import RolloutEngine
    from rl_engine.rollout.weight_receiver import WeightReleaseError
    from tests.helpers.rollout.weight_sync_procs import PROMPTS, manifest_of, sampling

    model = load_model("tiny-llama", dtype=torch.float32, seed=0)[0]
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = engine.weight_receiver(manifest_of(model), bucket_bytes=1 << 20)
    dropped = receiver._buckets[-1].pop()  # a sync that would leave part of a tensor unwritten
    name = receiver.manifest.tensors[dropped.tensor].name
    with pytest.raises(WeightReleaseError, match=name):
        engine.release_weights(receiver)
    for key, tensor in model.state_dict().items():  # nothing was released
        assert torch.equal(tensor, before[key]), key
    assert len(engine.generate(PROMPTS, sampling())) == 2 * len(PROMPTS)  # still served

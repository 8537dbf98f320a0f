"""Ray placement of the job's actors: with `device: cuda` every engine and trainer rank gets one GPU.

A `ray.cluster_utils.Cluster` of two nodes that each declare one GPU (no real
GPU needed: only placement is checked). Actors started with the job's
`actor_resources` land one per GPU, on different nodes, each seeing only its
own GPU (CUDA_VISIBLE_DEVICES), and a third finds no GPU left. On cpu they ask
for none.
"""

import pytest
import ray
from ray.cluster_utils import Cluster

from rl_engine.config import RunConfig
from rl_engine.executors.job.actors.launch import actor_resources


def test_actor_resources_follow_the_device():
    assert actor_resources(RunConfig()) == {"num_cpus": 1, "num_gpus": 0}
    assert actor_resources(RunConfig(device="cuda")) == {"num_cpus": 1, "num_gpus": 1}


@pytest.mark.multiprocess
@pytest.mark.own_ray
def test_cuda_actors_get_one_gpu_each_on_a_cluster_with_gpu_nodes():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, num_gpus=1)
    try:
        ray.init(address=cluster.address)

        @ray.remote
        class Probe:  # defined here: pickled by value, no shared working directory needed
            def where(self):
                import os

                node = ray.get_runtime_context().get_node_id()
                return node, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

        resources = actor_resources(RunConfig(device="cuda"))
        actors = [Probe.options(**resources).remote() for _ in range(2)]
        places = ray.get([a.where.remote() for a in actors], timeout=120)
        assert len({node for node, _, _ in places}) == 2, places  # one GPU per node
        for _, gpus, visible in places:
            assert len(gpus) == 1 and visible == str(gpus[0])
        extra = Probe.options(**resources).remote()
        ready, _ = ray.wait([extra.where.remote()], timeout=3)
        assert not ready, "a third GPU actor was placed on a cluster with two GPUs"
        on_cpu = Probe.options(**actor_resources(RunConfig())).remote()
        _, gpus, _ = ray.get(on_cpu.where.remote(), timeout=120)
        assert gpus == []
    finally:
        ray.shutdown()
        cluster.shutdown()

"""The job on a two-node Ray cluster built on this machine (`ray.cluster_utils.Cluster`).

Each node is its own raylet with its own declared CPUs; the head node has none, so every
actor lands on one of the two. Both nodes share this machine's IP and filesystem: what
that leaves untested is listed in docs/scaling.md.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import ray
from ray.cluster_utils import Cluster

from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import job_config

# a multi-raylet cluster plus a job: 35-65 s each
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.own_ray]


@pytest.fixture
def two_nodes():
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield [node.node_id for node in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_zero3_ranks_and_engines_one_per_node_keep_exact_parity(tmp_path, two_nodes):
    """2 ranks (ZeRO-3, strict_spread) and 2 engines (strict_spread): one of each per node;
    MASTER_ADDR is rank 0's node address; parity exact-match 1.0 at every step."""
    run = tmp_path / "run"
    config = job_config(
        run,
        steps=2,
        trainer={"num_ranks": 2, "zero_stage": 3, "placement": "strict_spread"},
        rollout={"num_engines": 2, "placement": "strict_spread"},
    )
    history = run_job(config)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/num_tokens"] > 0
    actors = json.loads((run / "actors.json").read_text())
    for role in ("trainer rank", "rollout engine"):
        nodes = sorted(a["node_id"] for a in actors if a["role"] == role)
        assert nodes == sorted(two_nodes), f"{role}s not one per node: {nodes}"


@pytest.mark.exhaustive
def test_ray_job_submit_to_an_existing_cluster(tmp_path):
    """`ray job submit`'s path: the entrypoint runs with RAY_ADDRESS set and must join the
    running cluster without declaring resources (ray.init(num_cpus=...) would raise)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from rl_engine.executors.worker.distributed import free_port
    from tests.helpers.job.jobs import REPO, wait_for, write_config

    os.environ.pop("RAY_ADDRESS", None)
    port = free_port()
    # the job agent gets a port of its own: Ray's default (52365) is taken while another pytest
    # worker's shared cluster is up, and the dashboard then never finds an agent to submit to
    head = {
        "num_cpus": 2,
        "include_dashboard": True,
        "dashboard_port": port,
        "dashboard_agent_listen_port": free_port(),
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        run = tmp_path / "run"
        config = write_config(job_config(run, steps=2), tmp_path / "job.yaml")
        client = JobSubmissionClient(f"http://127.0.0.1:{port}")
        job = _submit_when_agent_is_up(
            client,
            entrypoint=f"{sys.executable} -m rl_engine.cli train --config {config}",
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}},
        )
        done = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
        wait_for(lambda: client.get_job_status(job) in done, 300, what="the submitted job")
        logs = client.get_job_logs(job)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-3000:]
        assert "connecting to the Ray cluster" in logs and "done: 2 steps" in logs
    finally:
        cluster.shutdown()


def _submit_when_agent_is_up(client, timeout: float = 120, **job) -> str:
    """The dashboard answers before its job agent is up (seconds later on a loaded machine)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(1)

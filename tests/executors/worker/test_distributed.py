"""A rank's distributed environment (executors/worker/distributed.py): RANK / WORLD_SIZE /
LOCAL_RANK parsed with single-process defaults, each bad value named with its variable, and a
free TCP port that can really be bound."""

from __future__ import annotations

import os
import socket

import pytest

from rl_engine.executors.worker import distributed
from rl_engine.executors.worker.distributed import (
    RENDEZVOUS_PORTS,
    DistEnv,
    ephemeral_ports,
    free_port,
)

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for key in VARIABLES:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_ports_are_drawn_outside_the_kernels_ephemeral_range():
    """The kernel hands ephemeral ports to outgoing connections between the draw and the
    rendezvous's bind; a drawn port is never one of them, and draws are not a fixed sequence."""
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    assert all(p in RENDEZVOUS_PORTS and p not in ephemeral for p in ports), ports
    assert len(set(ports)) > 1
    with socket.socket() as sock:  # control: the kernel's own pick is ephemeral
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] in ephemeral


def test_a_taken_port_is_not_drawn(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(distributed, "RENDEZVOUS_PORTS", range(port, port + 1))
        monkeypatch.setattr(distributed, "ephemeral_ports", lambda: range(0))
        assert free_port() != port  # the only candidate is bound: the kernel picks


def test_a_single_process_gets_defaults_written_back(clean_env):
    assert DistEnv.from_environ() == DistEnv(rank=0, world_size=1, local_rank=0)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "0",
        "1",
        "0",
    )
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"].isdigit()


def test_a_rank_of_a_world_reads_its_variables(clean_env):
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }.items():
        clean_env.setenv(key, value)
    assert DistEnv.from_environ() == DistEnv(rank=1, world_size=2, local_rank=1)  # LOCAL_RANK: RANK


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "-1"}, "environment variable RANK must be a non-negative int, got '-1'"),
        (
            {"WORLD_SIZE": "two"},
            "environment variable WORLD_SIZE must be a non-negative int, got 'two'",
        ),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be < WORLD_SIZE=2 (>= 1)"),
        ({"WORLD_SIZE": "0"}, "RANK=0 must be < WORLD_SIZE=0 (>= 1)"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT"),
    ],
)
def test_bad_values_name_their_variable(clean_env, env, message):
    for key, value in env.items():
        clean_env.setenv(key, value)
    with pytest.raises(ValueError) as caught:
        DistEnv.from_environ()
    assert message in str(caught.value)

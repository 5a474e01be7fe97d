"""Fixtures of the federation tests: the prompt set and a broker on loopback port 0."""

import pytest

from graft_fed.data.config import DataConfig, load_prompts
from tests.federation.helpers import broker_config, start_broker


@pytest.fixture()
def prompts(prompt_file):
    return load_prompts(DataConfig(source=str(prompt_file)))


@pytest.fixture(params=[False, True], ids=["grpc-in-broker", "front-process"])
def broker(prompt_file, request):
    """A broker serving gRPC itself, and one whose gRPC a front process serves
    (`front_process`, broker/front.py): every test that takes it runs on both."""
    server = start_broker(broker_config(prompt_file, front_process=request.param))
    yield server
    server.stop()

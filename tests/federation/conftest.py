"""Fixtures of the federation tests: the prompt set and a broker on loopback port 0."""

import pytest

from graft_fed.data.config import DataConfig, load_prompts
from tests.federation.helpers import broker_config, start_broker


@pytest.fixture()
def prompts(prompt_file):
    return load_prompts(DataConfig(source=str(prompt_file)))


@pytest.fixture()
def broker(prompt_file):
    server = start_broker(broker_config(prompt_file))
    yield server
    server.stop()

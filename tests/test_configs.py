"""Every config shipped in the repo loads into its dataclasses (so docs and examples stay true)."""

from pathlib import Path

import pytest

from graft_fed.broker.config import load_broker_config
from graft_fed.experiment import load_experiment_config
from graft_fed.node.node import load_node_config
from graft_fed.sim import load_sim_config
from graft_fed.trainer.config import load_train_config
from graft_fed.graft.cotrain import load_cotrain_config

ROOT = Path(__file__).resolve().parents[1]
LOADERS = {"configs/tiny-grpo.yaml": load_train_config, "configs/tiny-cotrain.yaml": load_cotrain_config,
           "configs/sim-zoo.yaml": load_sim_config, "nodes/zoo/broker.yaml": load_broker_config}


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("nodes/**/*.yaml")
                                        if p.name != "broker.yaml"))
def test_node_configs_load(path):
    load_node_config(ROOT / path)


@pytest.mark.parametrize("path", sorted(LOADERS))
def test_run_configs_load(path):
    LOADERS[path](ROOT / path)


def test_experiment_configs_load():
    for p in ROOT.glob("bench/*.yaml"):
        load_experiment_config(p)
        load_experiment_config(p, quick=True)

"""graft-fed: federated cross-model trajectory exchange (GRAFT) for RL with verifiable rewards."""

__version__ = "0.1.0"

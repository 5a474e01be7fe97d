"""Durable trajectory store: every group a run samples, for stored-peer GRAFT and sharing."""

from graft_fed.store.sqlite import TrajectoryStore

__all__ = ["TrajectoryStore"]

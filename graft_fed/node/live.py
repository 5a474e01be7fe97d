"""A node's contribution to the broker's live page: every metrics row the trainer writes
also goes, best effort, to the broker as a few scalars (BrokerClient.report_scalars).

It wraps the trainer's metrics writer (a metrics sink), so the training loop needs no
change: `attach_live_scalars(node)` once the node is built.
"""

from __future__ import annotations

from typing import Any, Mapping


class ScalarsToBroker:
    """A metrics writer that writes through to `inner` and forwards each row with a step to
    the broker; a broker that cannot be reached never fails the write."""

    def __init__(self, inner: Any, client: Any) -> None:
        self.inner, self.client = inner, client
        self.sent = 0

    def write(self, row: Mapping[str, Any]) -> None:
        self.inner.write(row)
        if "step" in row:
            try:
                self.sent += bool(self.client.report_scalars(int(row["step"]), dict(row)))
            except Exception:  # noqa: BLE001 - the live page must never cost a training step
                pass

    def close(self) -> None:
        self.inner.close()


def attach_live_scalars(node: Any) -> ScalarsToBroker | None:
    """Make `node`'s trainer report its step scalars to the broker; None when it has no
    trainer metrics writer or no broker client."""
    trainer, client = getattr(node, "trainer", None), getattr(node, "client", None)
    if trainer is None or client is None or not hasattr(trainer, "metrics"):
        return None
    if isinstance(trainer.metrics, ScalarsToBroker):
        return trainer.metrics
    trainer.metrics = ScalarsToBroker(trainer.metrics, client)
    return trainer.metrics

"""A federation node: one model's trainer whose exchange partner is the broker."""

"""The broker: matches all-fail groups to the most compatible peer's informative groups."""

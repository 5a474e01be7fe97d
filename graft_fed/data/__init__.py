"""Datasets, prompt templates, stable prompt ids and benchmark loaders."""

from graft_fed.data.prompts import Prompt, stable_prompt_id

__all__ = ["Prompt", "stable_prompt_id"]

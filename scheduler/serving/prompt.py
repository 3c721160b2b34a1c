"""Re-export: prompts and their encoding live beside the engine (scheduler/prompt.py)."""

from orcaserve.scheduler.prompt import ChatPrompt, Prompt, encode_prompt

__all__ = ["ChatPrompt", "Prompt", "encode_prompt"]

"""Sharded training checkpoints that a crash cannot half-write, resuming them on any topology, and exporting them."""

from litft.checkpoint.format import CheckpointMeta, complete_checkpoints, resolve_resume, safe_reader
from litft.checkpoint.manager import Checkpointer

__all__ = ["CheckpointMeta", "Checkpointer", "complete_checkpoints", "resolve_resume", "safe_reader"]

"""The ``--data`` choices. Each is a dataclass whose fields are its flags."""

from litft.data.base import DataModule, PreparedData
from litft.data.hf import HF
from litft.data.mix import Mix
from litft.data.preference import Preferences, TinyPreferences
from litft.data.prompts import Prompts, TinyPrompts
from litft.data.sft import JSON
from litft.data.text import TextFiles
from litft.data.tiny import TinyTasks

__all__ = ["DataModule", "PreparedData", "HF", "JSON", "Mix", "Preferences", "TextFiles", "TinyPreferences", "TinyTasks", "Prompts", "TinyPrompts"]

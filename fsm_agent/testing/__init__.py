"""Test helpers for users' own tests: recorded-traffic replay (and recording), scripted providers."""

from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .replay import RecordedResponse, ReplayServer

__all__ = ["RecordedResponse", "ReplayServer", "ScriptedProvider", "text_response", "tool_call_response"]

"""Test helpers for users' own tests: recorded-traffic replay (and recording), scripted providers."""

from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .record import Recorder, load_recording
from .replay import RecordedResponse, ReplayServer

__all__ = ["RecordedResponse", "Recorder", "ReplayServer", "ScriptedProvider", "load_recording", "text_response",
           "tool_call_response"]

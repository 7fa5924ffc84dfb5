"""Test helpers for users' own tests: recorded-traffic replay (and recording), scripted providers,
and a store that fails on purpose (:class:`FaultyStore`)."""

from ..providers.record import Recorder, load_recording
from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .faults import Fault, FaultyStore, carries_ledger
from .replay import RecordedResponse, ReplayServer

__all__ = ["Fault", "FaultyStore", "RecordedResponse", "Recorder", "ReplayServer", "ScriptedProvider", "carries_ledger",
           "load_recording", "text_response", "tool_call_response"]

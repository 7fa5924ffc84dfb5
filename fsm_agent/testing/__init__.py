"""Test helpers for users' own tests: recorded-traffic replay (and recording), scripted providers,
a store that fails on purpose (:class:`FaultyStore`), and the offline replay of a recorded
session (:func:`replay_trajectory`)."""

from ..providers.record import Recorder, load_recording
from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .faults import Fault, FaultyStore, carries_ledger
from .replay import RecordedResponse, ReplayServer
from .trajectory import RecordedTrajectory, RequestDifference, TrajectoryReport, read_trajectory, replay_trajectory

__all__ = ["Fault", "FaultyStore", "RecordedResponse", "RecordedTrajectory", "Recorder", "ReplayServer",
           "RequestDifference", "ScriptedProvider", "TrajectoryReport", "carries_ledger", "load_recording",
           "read_trajectory", "replay_trajectory", "text_response", "tool_call_response"]

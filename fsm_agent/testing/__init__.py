"""Test helpers for users' own tests: recorded-traffic replay (and recording), scripted providers,
a store that fails on purpose (:class:`FaultyStore`), the record and exact replay of a run's
effects (:class:`EffectRecording`), the offline replay of a recorded session's log
(:func:`replay_trajectory`), and random valid conversations with their pairing check
(:func:`random_conversation`, :func:`check_pairing`) for property tests of history edits."""

from ..providers.record import Recorder, load_recording
from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .effects import EffectRecording, RecordingPort, ReplayingPort
from .conversations import SUMMARY_PREFIX, Conversation, check_pairing, conversation_strategy, random_conversation
from .faults import Fault, FaultyStore, carries_ledger
from .replay import RecordedResponse, ReplayServer
from .trajectory import RecordedTrajectory, RequestDifference, TrajectoryReport, read_trajectory, replay_trajectory

__all__ = ["Conversation", "EffectRecording", "Fault", "FaultyStore", "RecordedResponse",
           "RecordedTrajectory", "Recorder", "RecordingPort", "ReplayServer", "ReplayingPort",
           "RequestDifference", "SUMMARY_PREFIX", "ScriptedProvider", "TrajectoryReport", "carries_ledger",
           "check_pairing", "conversation_strategy", "load_recording", "random_conversation",
           "read_trajectory", "replay_trajectory", "text_response", "tool_call_response"]

"""Test helpers for users' own tests: cassettes (a test's provider exchanges recorded once and replayed
by normalised request: :class:`Cassette`, :func:`use_cassette`, and the ``cassette`` fixture of
:mod:`fsm_agent.testing.pytest_plugin`), recorded-traffic replay (and recording), scripted providers,
a store that fails on purpose (:class:`FaultyStore`), the record and exact replay of a run's
effects (:class:`EffectRecording`), the offline replay of a recorded session's log
(:func:`replay_trajectory`), and random valid conversations with their pairing check
(:func:`random_conversation`, :func:`check_pairing`) for property tests of history edits."""

from ..providers.record import Recorder, load_recording
from ..providers.scripted import ScriptedProvider, text_response, tool_call_response
from .cassette import Cassette, CassetteMismatch, use_cassette
from .effects import EffectRecording, RecordingPort, ReplayingPort
from .conversations import SUMMARY_PREFIX, Conversation, check_pairing, conversation_strategy, random_conversation
from .faults import Fault, FaultyStore, carries_ledger
from .replay import RecordedResponse, ReplayServer
from .trajectory import RecordedTrajectory, RequestDifference, TrajectoryReport, read_trajectory, replay_trajectory

__all__ = ["Cassette", "CassetteMismatch", "Conversation", "EffectRecording", "Fault", "FaultyStore", "RecordedResponse",
           "RecordedTrajectory", "Recorder", "RecordingPort", "ReplayServer", "ReplayingPort",
           "RequestDifference", "SUMMARY_PREFIX", "ScriptedProvider", "TrajectoryReport", "carries_ledger",
           "check_pairing", "conversation_strategy", "load_recording", "random_conversation",
           "read_trajectory", "replay_trajectory", "text_response", "tool_call_response", "use_cassette"]

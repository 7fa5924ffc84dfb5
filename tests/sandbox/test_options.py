"""SandboxOptions: the options every sandbox takes, in one value, checked once; each sandbox takes
them as ``options=`` or as its keywords (not both), and the remote sandbox refuses the local ones.

Nothing here starts a sandbox: these run anywhere, as any user.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from fsm_agent.sandbox import (
    DEFAULT_UIDS,
    BubblewrapSandbox,
    ExecutionResult,
    Guarantees,
    Limits,
    RemoteSandbox,
    SandboxInputError,
    SandboxOptions,
    SubprocessSandbox,
    default_sandbox,
)
from fsm_agent.sandbox.options import LOCAL_ONLY, SandboxOptionsKeywords
from fsm_agent.sandbox.remote import RemoteRequest

LOCAL = (BubblewrapSandbox, SubprocessSandbox)


class Executor:
    """A RemoteExecutor that is never called."""

    async def describe(self) -> Guarantees:
        raise AssertionError("not called")

    async def execute(self, request: RemoteRequest) -> ExecutionResult:
        raise AssertionError("not called")

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("cls", LOCAL)
def test_options_and_keywords_configure_a_local_sandbox_alike(cls: Any, tmp_path: Any) -> None:
    fields: dict[str, Any] = dict(limits=Limits(cpu_seconds=3), required=("cpu_limited",), uids=[7, 8],
                                  python="/usr/bin/python3", keep_workdir=True, workdir_root=tmp_path,
                                  env={"MPLBACKEND": "Agg"})
    by_keywords = cls(**fields)
    by_value = cls(options=SandboxOptions(**fields))
    assert by_keywords.options == by_value.options
    for sb in (by_keywords, by_value):
        assert sb.limits == Limits(cpu_seconds=3) and sb.required == ("cpu_limited",) and sb.uids == (7, 8)
        assert sb.keep_workdir is True and sb.workdir_root == str(tmp_path) and dict(sb.env) == {"MPLBACKEND": "Agg"}
    default = cls()
    assert default.required == cls.DESIGNED and default.uids == tuple(DEFAULT_UIDS)
    assert default.options == SandboxOptions() and default.limits == Limits() and default.workdir_root is None


@pytest.mark.parametrize("cls", LOCAL)
def test_options_and_keywords_together_are_refused(cls: Any) -> None:
    with pytest.raises(SandboxInputError, match="options= or the keywords limits=, not both"):
        cls(options=SandboxOptions(), limits=Limits())
    with pytest.raises(SandboxInputError, match="options must be a SandboxOptions, not dict"):
        cls(options={"limits": Limits()})
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        cls(bogus=1)


def test_each_mechanism_keeps_its_own_keywords() -> None:
    sb = BubblewrapSandbox(options=SandboxOptions(uids=[9]), ro_binds=["/opt/venv/"], tmp_bytes=1 << 20)
    assert sb.ro_binds == ("/opt/venv",) and sb.tmp_bytes == 1 << 20 and sb.uids == (9,)
    sp = SubprocessSandbox(options=SandboxOptions(uids=[9]), ro_paths=["/data"], landlock=False)
    assert sp.ro_paths == ("/data",) and sp.landlock is False
    with pytest.raises(TypeError, match="ro_binds"):
        SubprocessSandbox(ro_binds=["/opt"])  # type: ignore[call-arg]
    with pytest.raises(SandboxInputError, match="ro_binds must be a list of absolute paths, not str"):
        BubblewrapSandbox(ro_binds="/opt/venv")
    with pytest.raises(SandboxInputError, match="ro_paths: 'data' must be an absolute path"):
        SubprocessSandbox(ro_paths=["data"])


@pytest.mark.parametrize(("fields", "message"), [
    ({"limits": 5}, "limits must be a Limits, not int"),
    ({"required": "network_isolated"}, "required must be a list of guarantee names"),
    ({"required": ["network"]}, r"unknown guarantee\(s\) \['network'\]"),
    ({"uids": 5}, "uids must be a non-empty list"),
    ({"uids": []}, "uids must be a non-empty list"),
    ({"uids": [True]}, "between 1 and 2147483646"),
    ({"uids": [5000, 5000]}, "uids must be distinct"),
    ({"python": 3}, "python must be a path, not int"),
    ({"python": "/usr/bin/\ud800"}, "lone surrogate"),
    ({"keep_workdir": "yes"}, "keep_workdir must be True or False"),
    ({"workdir_root": "/tmp/a\x00b"}, "workdir_root must be a text path without NUL"),
    ({"env": ["A=1"]}, "env must be a mapping"),
    ({"env": {"A=B": "1"}}, "is not an environment variable"),
])
def test_each_field_is_checked_once_with_a_clear_message(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SandboxInputError, match=message):
        SandboxOptions(**fields)
    for cls in LOCAL:  # the same check, the same message, through the keywords
        with pytest.raises(SandboxInputError, match=message):
            cls(**fields)


def test_options_are_a_frozen_value() -> None:
    opts = SandboxOptions(env={"A": "1"}, uids=range(10, 12))
    assert opts.uids == (10, 11)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        opts.keep_workdir = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        opts.env["B"] = "2"  # type: ignore[index]
    changed = attrs.evolve(opts, keep_workdir=True)
    assert changed.keep_workdir and changed.env == opts.env and changed != opts
    assert hash(opts) == hash(SandboxOptions(env={"A": "1"}, uids=(10, 11))) and "env={'A': '1'}" in repr(opts)


def test_the_remote_sandbox_takes_limits_and_required_and_refuses_the_local_fields() -> None:
    by_keywords = RemoteSandbox(Executor(), limits=Limits(cpu_seconds=2), required=["network_isolated"])
    by_value = RemoteSandbox(Executor(), options=SandboxOptions(limits=Limits(cpu_seconds=2),
                                                                required=["network_isolated"]))
    for sb in (by_keywords, by_value):
        assert sb.limits == Limits(cpu_seconds=2) and sb.required == ("network_isolated",)
    assert RemoteSandbox(Executor()).required == ()
    for name in LOCAL_ONLY:
        value: Any = {"uids": [5], "python": "/opt/py", "keep_workdir": True, "workdir_root": "/srv",
                      "env": {"A": "1"}}[name]
        with pytest.raises(SandboxInputError, match=f"only limits and required.*{name} applies to the local"):
            RemoteSandbox(Executor(), options=SandboxOptions(**{name: value}))
    with pytest.raises(SandboxInputError, match="unknown guarantee"):
        RemoteSandbox(Executor(), required=["network"])
    with pytest.raises(SandboxInputError, match="not both"):
        RemoteSandbox(Executor(), options=SandboxOptions(), limits=Limits())


def test_default_sandbox_passes_the_options_on() -> None:
    sb = default_sandbox(options=SandboxOptions(uids=[11], limits=Limits(cpu_seconds=4)))
    assert isinstance(sb, (BubblewrapSandbox, SubprocessSandbox))
    assert sb.uids == (11,) and sb.limits == Limits(cpu_seconds=4)


def test_the_keywords_type_names_every_field() -> None:
    """The TypedDict that types the constructors' keywords lists exactly the fields of SandboxOptions."""
    fields = {a.name for a in attrs.fields(SandboxOptions)}
    assert set(SandboxOptionsKeywords.__annotations__) == fields
    assert set(LOCAL_ONLY) == fields - {"limits", "required"}

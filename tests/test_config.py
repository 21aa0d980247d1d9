"""MoEConfig: every invalid field raises naming the field (and the value given); from_env reads MEGAMOE_*."""

from __future__ import annotations

import dataclasses
import decimal
import re

import pytest

from megamoe import MoEConfig

INVALID = [
    ("backend", "cuda", ValueError),
    ("backend", "Torch", ValueError),
    ("backend", None, ValueError),
    ("capacity_factor", 0, ValueError),
    ("capacity_factor", -1.5, ValueError),
    ("capacity_factor", float("nan"), ValueError),
    ("capacity_factor", "1.0", TypeError),
    ("capacity_factor", True, TypeError),
    ("capacity_factor", 10**400, ValueError),  # an int beyond the floats (not an OverflowError)
    ("block_m", 0, ValueError),
    ("block_m", 3, ValueError),
    ("block_m", 48, ValueError),
    ("block_m", 2048, ValueError),
    ("block_m", -16, ValueError),
    ("block_m", 16.0, ValueError),
    ("block_m", True, ValueError),
    ("num_comm_sms", 0, ValueError),
    ("num_comm_sms", -4, ValueError),
    ("num_comm_sms", 2.5, ValueError),
    ("num_comm_sms", True, ValueError),
    # Past the custom ops' int64: was accepted, then every call failed there, even the torch path's that ignores it.
    ("num_comm_sms", 2**63, ValueError),
    ("num_comm_sms", 2**31, ValueError),
    ("minibatch_tokens", 0, ValueError),
    ("minibatch_tokens", "64", ValueError),
    ("minibatch_tokens", False, ValueError),
    # Past the int32 rows of any rank: was accepted, then an OverflowError in the fused EP kernels' launch.
    ("minibatch_tokens", 2**31, ValueError),
    ("minibatch_tokens", 10**23, ValueError),
    ("dispatch", "pushpull", ValueError),
    ("dispatch", None, ValueError),
    ("combine", "PULL", ValueError),
    ("comm_timeout_ms", 0, ValueError),
    ("comm_timeout_ms", -1, ValueError),
    ("comm_timeout_ms", 1.5, ValueError),
    ("comm_timeout_ms", None, ValueError),
    # Past what the waits take (a datetime.timedelta in the agreement exchange, nanoseconds in an int64 on the
    # GPU): was accepted, then an OverflowError at the second call of an expert-parallel group.
    ("comm_timeout_ms", 10**17, ValueError),
    ("comm_timeout_ms", 2**31, ValueError),
]


@pytest.mark.parametrize("field,value,exc", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_field(field, value, exc):
    if field not in {f.name for f in dataclasses.fields(MoEConfig)}:
        pytest.fail(f"MoEConfig has no field {field!r}")
    with pytest.raises(exc) as info:
        MoEConfig(**{field: value})
    message = str(info.value)
    assert re.search(rf"\b{field}\b", message), f"message does not name {field!r}: {message}"
    shown = type(value).__name__ if exc is TypeError else repr(value) if isinstance(value, str) else str(value)
    given = message.partition("got ")[2]  # not what is allowed: "> 0" or "[1, 1024]" would show a 0 value
    assert shown in given or repr(value) in given, f"message does not show the value {value!r}: {message}"


VALID = [
    ("backend", "auto"), ("backend", "reference"), ("backend", "torch"), ("backend", "triton"),
    ("capacity_factor", None), ("capacity_factor", 1), ("capacity_factor", 0.01), ("capacity_factor", 8.0),
    ("block_m", None), ("block_m", 1), ("block_m", 64), ("block_m", 1024),
    ("num_comm_sms", 1), ("num_comm_sms", 2**31 - 1), ("minibatch_tokens", 4096), ("minibatch_tokens", 2**31 - 1),
    ("dispatch", "pull"), ("dispatch", "push"), ("combine", "push"), ("combine", "auto"),
    ("comm_timeout_ms", 1), ("comm_timeout_ms", 2**31 - 1),
]


@pytest.mark.parametrize("field,value", VALID, ids=[f"{f}={v!r}" for f, v in VALID])
def test_valid_field(field, value):
    assert getattr(MoEConfig(**{field: value}), field) == value


@pytest.mark.parametrize("kind,number", [("float32", 1.5), ("float16", 0.5), ("float64", 2.0), ("int64", 3)], ids=str)
def test_capacity_factor_numpy_scalar(kind, number):
    """Any real number but a bool is accepted (NumPy's scalars too), stored as a Python float."""
    np = pytest.importorskip("numpy")
    config = MoEConfig(capacity_factor=getattr(np, kind)(number))
    assert type(config.capacity_factor) is float and config.capacity_factor == number
    assert config == MoEConfig(capacity_factor=float(number))


@pytest.mark.parametrize("kind,value,exc", [("float32", "nan", ValueError), ("float32", "inf", ValueError),
                                            ("float32", "-1.5", ValueError), ("int64", "0", ValueError),
                                            ("bool_", "1", TypeError), ("str_", "1.5", TypeError)], ids=str)
def test_capacity_factor_numpy_scalar_rejected(kind, value, exc):
    """NumPy's scalars meet the rules of Python's numbers: NaN, inf and <= 0 are ValueErrors, a bool or a string
    a TypeError, each naming capacity_factor."""
    np = pytest.importorskip("numpy")
    scalar = getattr(np, kind)(value if kind in ("str_", "bool_") else float(value))
    with pytest.raises(exc, match=r"\bcapacity_factor\b"):
        MoEConfig(capacity_factor=scalar)


@pytest.mark.parametrize("value", ["1.5", decimal.Decimal("1.5"), [2.0]], ids=repr)
def test_capacity_factor_type_error_shows_the_value(value):
    """A capacity_factor of the wrong type is shown with its value: "got str" said not what was passed, and for a
    Decimal ("must be None or a number > 0, got Decimal") not why a number was refused."""
    with pytest.raises(TypeError) as info:
        MoEConfig(capacity_factor=value)
    allowed, _, given = str(info.value).partition(", got ")
    assert allowed.endswith("capacity_factor must be None or a real number > 0 (an int or a float)"), info.value
    assert repr(value) in given, info.value


def test_reference_backend_takes_no_capacity():
    """backend="reference" computes every pair (no receive buffer, no overflow to raise): a capacity_factor beside it
    was silently ignored (routing that overflows it ran without a CapacityOverflowError); now a ValueError naming both."""
    with pytest.raises(ValueError, match=r"capacity_factor.*backend='reference'.*got 0\.5"):
        MoEConfig(backend="reference", capacity_factor=0.5)
    assert MoEConfig(backend="reference").capacity_factor is None


def test_defaults_are_dropless_and_auto():
    config = MoEConfig()
    assert (config.backend, config.capacity_factor, config.block_m, config.dispatch, config.combine) == (
        "auto", None, None, "auto", "auto"
    )


def test_frozen_and_hashable():
    config = MoEConfig(block_m=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_m = 32
    assert hash(config) == hash(MoEConfig(block_m=16)) and config == MoEConfig(block_m=16)


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("MEGAMOE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_from_env_reads_megamoe_vars(clean_env):
    clean_env.setenv("MEGAMOE_BACKEND", "torch")
    clean_env.setenv("MEGAMOE_CAPACITY_FACTOR", "1.5")
    clean_env.setenv("MEGAMOE_BLOCK_M", "32")
    config = MoEConfig.from_env()
    assert (config.backend, config.capacity_factor, config.block_m) == ("torch", 1.5, 32)
    assert isinstance(config.block_m, int) and isinstance(config.capacity_factor, float)


def test_from_env_overrides_win(clean_env):
    clean_env.setenv("MEGAMOE_BACKEND", "torch")
    clean_env.setenv("MEGAMOE_BLOCK_M", "32")
    config = MoEConfig.from_env(block_m=8, dispatch="push")
    assert (config.backend, config.block_m, config.dispatch) == ("torch", 8, "push")


def test_from_env_without_vars_is_default(clean_env):
    assert MoEConfig.from_env() == MoEConfig()


def test_env_is_read_only_by_from_env(clean_env):
    """No hidden global state: a plain MoEConfig() ignores MEGAMOE_* variables."""
    clean_env.setenv("MEGAMOE_BACKEND", "reference")
    clean_env.setenv("MEGAMOE_BLOCK_M", "4")
    assert MoEConfig() == MoEConfig(backend="auto", block_m=None)


@pytest.mark.parametrize(
    "var,value,field",
    [("MEGAMOE_BACKEND", "gpu", "backend"), ("MEGAMOE_BLOCK_M", "3", "block_m"),
     ("MEGAMOE_CAPACITY_FACTOR", "-1", "capacity_factor"),
     ("MEGAMOE_BLOCK_M", "sixteen", "block_m"), ("MEGAMOE_CAPACITY_FACTOR", "lots", "capacity_factor")],
    ids=["backend-gpu", "block_m-3", "capacity-negative", "block_m-not-a-number", "capacity-not-a-number"],
)
def test_from_env_invalid_value_names_it(clean_env, var, value, field):
    """A bad environment value raises a ValueError that names the variable or the field it feeds."""
    clean_env.setenv(var, value)
    with pytest.raises(ValueError) as info:
        MoEConfig.from_env()
    message = str(info.value)
    assert var in message or re.search(rf"\b{field}\b", message), f"message names neither {var} nor {field}: {message}"


ENV_INVALID = [
    ("MEGAMOE_BLOCK_M", "48"), ("MEGAMOE_BLOCK_M", "0"), ("MEGAMOE_BLOCK_M", "-16"), ("MEGAMOE_BLOCK_M", "2048"),
    ("MEGAMOE_BLOCK_M", "sixteen"), ("MEGAMOE_BLOCK_M", "16.0"),
    ("MEGAMOE_CAPACITY_FACTOR", "nan"), ("MEGAMOE_CAPACITY_FACTOR", "inf"), ("MEGAMOE_CAPACITY_FACTOR", "1e400"),
    ("MEGAMOE_CAPACITY_FACTOR", "0"), ("MEGAMOE_CAPACITY_FACTOR", "-1"), ("MEGAMOE_CAPACITY_FACTOR", "lots"),
    ("MEGAMOE_BACKEND", "TORCH"), ("MEGAMOE_BACKEND", ""), ("MEGAMOE_BACKEND", "gpu"),
]


@pytest.mark.parametrize("var,value", ENV_INVALID, ids=[f"{v}={x!r}" for v, x in ENV_INVALID])
def test_from_env_error_names_variable_and_value(clean_env, var, value):
    """Every error for a value read from the environment (a range or a choice as much as a parse failure) names
    the variable and the value it holds: the user set the variable, not the field."""
    clean_env.setenv(var, value)
    with pytest.raises(ValueError) as info:
        MoEConfig.from_env()
    message = str(info.value)
    assert var in message and repr(value) in message, f"message does not name {var}={value!r}: {message}"


@pytest.mark.parametrize("value", ["48", "sixteen"], ids=["invalid", "unparseable"])
def test_from_env_invalid_value_overridden(clean_env, value):
    """A keyword override wins over an invalid variable, parseable or not: its value is not used (an unparseable
    one used to raise)."""
    clean_env.setenv("MEGAMOE_BLOCK_M", value)
    assert MoEConfig.from_env(block_m=16).block_m == 16


@pytest.mark.parametrize("override", [{}, {"backend": "reference"}], ids=["both-variables", "override"])
def test_from_env_clash_names_the_variables(clean_env, override):
    """Variables valid alone that clash (a capacity factor with the reference backend), with each other or with an
    override: the error names the variables the user set, not only the fields (it named neither variable)."""
    clean_env.setenv("MEGAMOE_CAPACITY_FACTOR", "0.5")
    if not override:
        clean_env.setenv("MEGAMOE_BACKEND", "reference")
    with pytest.raises(ValueError, match=r"backend='reference'.*MEGAMOE_CAPACITY_FACTOR='0\.5'"):
        MoEConfig.from_env(**override)
    clean_env.setenv("MEGAMOE_BACKEND", "torch")  # an invalid override alone: its own error, no variable named
    with pytest.raises(ValueError, match=r"block_m.*got 3$"):
        MoEConfig.from_env(block_m=3)


def test_recompute_numpy_bool_names_its_type():
    """recompute is a flag: NumPy's bool is a TypeError naming its type with its module (NumPy calls it "bool" too:
    the message read "must be a bool, got bool np.True_")."""
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"MoEConfig\.recompute must be a bool .*got numpy\.bool"):
        MoEConfig(recompute=np.True_)
    with pytest.raises(TypeError, match=r"MoEConfig\.recompute must be a bool .*got int 1$"):
        MoEConfig(recompute=1)


@pytest.mark.parametrize("field", ["block_m", "num_comm_sms", "minibatch_tokens", "comm_timeout_ms"])
def test_int_field_numpy_scalar_says_not_an_int(field):
    """A NumPy integer is refused as not an int, and the message says so: "must be a power of two in [1, 1024], got
    np.int64(32)" named a value that is one."""
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=rf"^MoEConfig\.{field} must be .*, got numpy\.int64 np\.int64\(32\), not an int$"):
        MoEConfig(**{field: np.int64(32)})

"""Bad input to the public API: ``Chameleon(...)``, ``parse_size`` and ``format_bytes``.

What the issue asks of the size arguments (``budget``, ``min_tensor_bytes``,
``device_memory_limit``, ``host_memory_limit``, ``host_memory_reserve``): an int of bytes or a size string with a decimal
(KB, MB, ...) or binary (KiB, MiB, ..., and bare K, M, G, T) unit; ``None`` means "no limit" where
that makes sense; anything else (negative, NaN, inf, bool, an unparsable string, a list, a dict, a
complex, ...) raises ``ValueError`` or ``TypeError`` whose message names the argument and lists the
accepted forms, and nothing else ever escapes. A constructor that fails leaves nothing behind: no
copy worker thread is started.

The parse table below is what ``config.py`` implements, checked exactly; the hypothesis tests check
it against an independent oracle built on ``decimal.Decimal`` (a size string is exact: '4.1MB' is
4100000 bytes). Size strings above ``config._MAX_BYTES`` (2**64) are rejected as a typo.
"""
from __future__ import annotations

import decimal
import math
import re
import threading
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import chameleon_swap as cs
from chameleon_swap import config as cfg
from chameleon_swap import policy as policy_pkg

SIZE_ARGS = ("budget", "min_tensor_bytes", "device_memory_limit", "host_memory_limit",
             "host_memory_reserve")
ALL_ARGS = SIZE_ARGS + ("policy", "device")

# The accepted forms every size error must list (config._ACCEPTED, spelled out here so a message
# that stops listing them fails).
ACCEPTED_MARKERS = ("int", "'512MB'", "'1.5GiB'", "KB", "MB", "GB", "KiB", "MiB", "GiB")

# The unit table, independent of config._UNITS: what the documentation promises.
UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}


# Strings above this are "too large" (config._MAX_BYTES); below it every size string is exact.
CAP = getattr(cfg, "_MAX_BYTES", 2**64)


def chameleon_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("chameleon-")]


@pytest.fixture
def no_threads_left_behind():
    """Fail the test if it leaves a chameleon copy worker (or any extra thread) running."""
    before_ids = {id(t) for t in chameleon_threads()}
    before_count = threading.active_count()
    yield
    new = [t.name for t in chameleon_threads() if id(t) not in before_ids and t.is_alive()]
    assert new == [], f"copy workers left running: {new}"
    assert threading.active_count() <= before_count, threading.enumerate()


_NO_VALUE = object()


def check_message(exc: BaseException, name: str, *, accepted: bool = True,
                  value: object = _NO_VALUE) -> str:
    """The message names ``name`` and (for size arguments) lists the accepted forms; it does not
    blame another argument (the offending ``value``, quoted back, may say anything)."""
    msg = str(exc)
    assert re.search(rf"\b{re.escape(name)}\b", msg), f"{name!r} not named in: {msg}"
    if accepted:
        for marker in ACCEPTED_MARKERS:
            assert marker in msg, f"accepted form {marker!r} not listed in: {msg}"
    rest = msg if value is _NO_VALUE else msg.replace(repr(value), "")
    for other in ALL_ARGS:
        if other != name:
            assert not re.search(rf"\b{other}\b", rest), f"{other!r} blamed in: {msg}"
    return msg


def make(**kw) -> cs.Chameleon:
    kw.setdefault("device", "cpu")
    return cs.Chameleon(**kw)


# --------------------------------------------------------------------------- parse table
TABLE = [
    # bare numbers are bytes
    ("0", 0), ("1", 1), ("4096", 4096), ("007", 7),
    # decimal (SI) units
    ("1B", 1), ("1KB", 1000), ("1MB", 10**6), ("1GB", 10**9), ("1TB", 10**12),
    ("512MB", 512 * 10**6), ("2.5GB", 2_500_000_000), ("0.5KB", 500),
    # binary (IEC) units and their one-letter short forms
    ("1KiB", 1024), ("1MiB", 2**20), ("1GiB", 2**30), ("1TiB", 2**40),
    ("1K", 1024), ("1M", 2**20), ("1G", 2**30), ("1T", 2**40),
    ("1.5GiB", 3 * 2**29), (".5GiB", 2**29), ("0.25MiB", 2**18), ("6GiB", 6 * 2**30),
    # case does not matter
    ("1kb", 1000), ("1kib", 1024), ("1KIB", 1024), ("1gIb", 2**30), ("1k", 1024), ("3b", 3),
    # whitespace around the number and between number and unit
    ("512 MB", 512 * 10**6), ("  1KiB  ", 1024), ("1\tGiB", 2**30), ("\n64\n", 64),
    # exponents
    ("1e3", 1000), ("1E3", 1000), ("2e3KB", 2 * 10**6), ("1e+2", 100), ("1.5e1KiB", 15 * 1024),
    # a larger unit is rounded down to whole bytes
    ("0.3KiB", 307), ("1.3GiB", 1395864371),
]

# Not a whole number of bytes: an error, never 0 or 1 byte (a size is bytes, not a fraction).
FRACTIONAL = ["1.5", "1.5B", "0.9", "1e-3", "0.0001KB", "0.5", 0.5, 1.5, 1.9, 1e-9]


@pytest.mark.parametrize("value", FRACTIONAL, ids=[repr(v) for v in FRACTIONAL])
def test_a_fraction_of_a_byte_is_an_error(value):
    with pytest.raises(ValueError, match="not a whole number of bytes") as e:
        cs.parse_size(value, "budget")
    check_message(e.value, "budget", value=value)
    with pytest.raises(ValueError, match="budget"):
        make(budget=value)


def test_budget_half_says_it_is_not_a_fraction_of_memory():
    with pytest.raises(ValueError, match="not a fraction of memory"):
        make(budget=0.5)


@pytest.mark.parametrize("text,expected", TABLE, ids=[repr(t) for t, _ in TABLE])
def test_parse_table(text, expected):
    got = cs.parse_size(text)
    assert got == expected and type(got) is int


def test_parse_ints_floats_and_none():
    assert cs.parse_size(None) is None
    for n in (0, 1, 4096, 2**40, 2**63):
        got = cs.parse_size(n)
        assert got == n and type(got) is int
    # Finite non-negative floats that are whole numbers of bytes are accepted.
    assert cs.parse_size(2e9) == 2 * 10**9 and type(cs.parse_size(2e9)) is int
    assert cs.parse_size(0.0) == 0 and cs.parse_size(-0.0) == 0
    assert cs.parse_size(1.5 * 2**30) == 3 * 2**29
    assert cs.parse_size(1e15) == 10**15


def test_parse_size_none_when_not_allowed():
    with pytest.raises(TypeError) as e:
        cs.parse_size(None, "min_tensor_bytes", allow_none=False)
    check_message(e.value, "min_tensor_bytes")
    assert "None" in str(e.value)


INVALID_VALUES = [
    # (value, exception, a word the message must contain about what was wrong)
    (-1, ValueError, "negative"),
    (-(2**70), ValueError, "negative"),
    (-0.5, ValueError, "-0.5"),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    (float("-inf"), ValueError, "inf"),
    (True, TypeError, "bool"),
    (False, TypeError, "bool"),
    ("", ValueError, "''"),
    ("   ", ValueError, "'   '"),
    ("MB", ValueError, "'MB'"),
    ("-1", ValueError, "'-1'"),
    ("-1MB", ValueError, "'-1MB'"),
    ("+1", ValueError, "'+1'"),
    ("1PB", ValueError, "'1PB'"),          # peta is not in the table
    ("1MBB", ValueError, "'1MBB'"),
    ("1 2", ValueError, "'1 2'"),
    ("1,000", ValueError, "'1,000'"),
    ("1_000", ValueError, "'1_000'"),      # float() would take it; a size string does not
    ("0x10", ValueError, "'0x10'"),
    ("nan", ValueError, "'nan'"),
    ("inf", ValueError, "'inf'"),
    ("infinity", ValueError, "'infinity'"),
    ("1.", ValueError, "'1.'"),
    ("1e", ValueError, "'1e'"),
    ("1 e3", ValueError, "'1 e3'"),
    ("MB512", ValueError, "'MB512'"),
    ("1kbit", ValueError, "'1kbit'"),
    ("1 bytes", ValueError, "'1 bytes'"),
    ("\u0661\u0662", ValueError, "'"),     # Arabic-Indic digits: not ASCII digits
    ("1e400", ValueError, "too large"),    # overflows a float
    ("1e308TB", ValueError, "too large"),
    ([512], TypeError, "list"),
    ([], TypeError, "list"),
    ({"budget": 1}, TypeError, "dict"),
    (1 + 2j, TypeError, "complex"),
    (b"512MB", TypeError, "bytes"),
    ((1, 2), TypeError, "tuple"),
    ({1}, TypeError, "set"),
    (object(), TypeError, "object"),
    (decimal.Decimal("5"), TypeError, "Decimal"),
    (Fraction(1, 2), TypeError, "Fraction"),
    (torch.tensor(5), TypeError, "Tensor"),
]
INVALID_IDS = [f"{type(v).__name__}:{v!r}"[:40] for v, _, _ in INVALID_VALUES]


@pytest.mark.parametrize("value,exc,word", INVALID_VALUES, ids=INVALID_IDS)
@pytest.mark.parametrize("name", SIZE_ARGS)
def test_parse_size_rejects(name, value, exc, word):
    with pytest.raises(exc) as e:
        cs.parse_size(value, name)
    msg = check_message(e.value, name, value=value)
    assert word.lower() in msg.lower(), msg


def test_parse_size_default_name_is_size():
    with pytest.raises(ValueError, match=r"^size must be"):
        cs.parse_size("lots")


# --------------------------------------------------------------------------- format_bytes
@pytest.mark.parametrize("n,text", [
    (None, "unlimited"), (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
    (1536, "1.50 KiB"), (3 * 2**20, "3.00 MiB"), (int(1.5 * 2**30), "1.50 GiB"),
    (2**40, "1.00 TiB"), (2**50, "1024.00 TiB"), (10**6, "976.56 KiB"), (-5, "-5 B"),
    (-2048, "-2.00 KiB"), (512.0, "512 B"),
])
def test_format_bytes_table(n, text):
    assert cs.format_bytes(n) == text


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 2**60))
def test_format_bytes_parses_back_within_rounding(n):
    text = cs.format_bytes(n)
    assert re.fullmatch(r"-?\d+(\.\d\d)? (B|KiB|MiB|GiB|TiB)", text), text
    back = cs.parse_size(text)
    if text.endswith(" B"):
        assert back == n
    else:
        # Two decimals of the unit: at most half a hundredth of a unit (<= 0.5% of the value,
        # the unit being <= the value), plus the round-down to a whole byte.
        unit = UNITS[text.split()[1]]
        assert abs(back - n) <= 0.005 * unit + 1, (n, text, back)


# --------------------------------------------------------------------------- round trips
@settings(max_examples=300, deadline=None)
@given(n=st.one_of(st.integers(0, 2**53), st.integers(2**53, CAP)))
def test_int_and_its_decimal_string_round_trip(n):
    assert cs.parse_size(n) == n
    assert cs.parse_size(str(n)) == n
    assert cs.parse_size(f"  {n} B ") == n


@settings(max_examples=400, deadline=None)
@given(unit=st.sampled_from(sorted(UNITS)), data=st.data(),
       space=st.sampled_from(["", " ", "  ", "\t"]),
       case=st.sampled_from([str, str.lower, str.upper]))
def test_units_table_round_trip(unit, data, space, case):
    mult = UNITS[unit]
    n = data.draw(st.integers(0, CAP // mult), label="n")
    text = f"{n}{space}{case(unit)}" if unit else str(n)
    got = cs.parse_size(text)
    assert got == n * mult and type(got) is int, (text, got)


@settings(max_examples=300, deadline=None)
@given(unit=st.sampled_from(["KiB", "MiB", "GiB", "TiB", "K", "M", "G", "T"]),
       n=st.integers(0, 2**20), frac_bits=st.integers(0, 10))
def test_binary_fractions_are_exact(unit, n, frac_bits):
    # n / 2**frac_bits has a finite decimal expansion and is exact in binary: so is the product.
    value = Fraction(n, 2**frac_bits)
    text = f"{decimal.Decimal(n) / decimal.Decimal(2**frac_bits)}{unit}"
    assert cs.parse_size(text) == math.floor(value * UNITS[unit]), text


# --------------------------------------------------------------------------- oracle property
_NUMBER = st.builds(
    lambda whole, frac, exp: whole + frac + exp,
    st.from_regex(r"[0-9]{1,8}", fullmatch=True),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,6}", fullmatch=True)),
    st.one_of(st.just(""), st.builds(lambda e, s, k: f"{e}{s}{k}", st.sampled_from("eE"),
                                     st.sampled_from(["", "+", "-"]), st.integers(0, 12))),
)
_BAD_UNITS = ["PB", "PiB", "EB", "bit", "kbit", "KiBB", "iB", "bytes", "kB2", "Mi", "Gb/s", "%"]


def _oracle(number: str, unit: str, floor: bool = True):
    """Exact bytes for a valid number and unit: floor(Decimal(number) * multiplier), computed
    with enough digits that nothing rounds."""
    with decimal.localcontext() as ctx:
        ctx.prec = 200
        value = decimal.Decimal(number) * UNITS_LOWER[unit.lower()]
        return math.floor(value) if floor else value


UNITS_LOWER = {k.lower(): v for k, v in UNITS.items()}


def _fractional(number: str, unit: str) -> bool:
    """Refused as a fraction of a byte: not whole in bytes, or under one byte but not 0."""
    exact = _oracle(number, unit, floor=False)
    return exact != math.floor(exact) and (UNITS_LOWER[unit.lower()] == 1 or exact < 1)


@settings(max_examples=400, deadline=None)
@given(number=_NUMBER,
       unit=st.one_of(st.sampled_from(sorted(UNITS)), st.sampled_from(_BAD_UNITS)),
       sign=st.sampled_from(["", "", "", "-", "+"]),
       pad=st.tuples(st.sampled_from(["", " ", "\t"]), st.sampled_from(["", " "]),
                     st.sampled_from(["", " ", "\n"])),
       case=st.sampled_from([str, str.lower, str.upper]))
def test_structured_strings_against_decimal_oracle(number, unit, sign, pad, case):
    text = f"{pad[0]}{sign}{number}{pad[1]}{case(unit)}{pad[2]}"
    valid = sign == "" and unit.lower() in UNITS_LOWER
    too_large = valid and _oracle(number, unit, floor=False) > CAP
    valid = valid and (too_large or not _fractional(number, unit))
    if not valid or too_large:
        with pytest.raises(ValueError) as e:
            cs.parse_size(text, "budget")
        check_message(e.value, "budget", value=text)
        if too_large:
            assert "too large" in str(e.value)
        return
    got = cs.parse_size(text, "budget")
    assert got == _oracle(number, unit) and type(got) is int, text


_ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    # At most 8 characters: an exponent of a million or more is test_absurd_exponent's case.
    st.text(max_size=8), st.text(alphabet="0123456789.eE+- kKmMgGtTiIbB\t", max_size=8),
    st.binary(max_size=6), st.complex_numbers(), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.tuples(st.integers()), st.fractions(), st.decimals(allow_nan=True),
    st.sets(st.integers(), max_size=2), st.just(object()), st.just(Ellipsis),
)


@settings(max_examples=600, deadline=None)
@given(value=_ANYTHING, name=st.sampled_from(SIZE_ARGS), allow_none=st.booleans())
def test_parse_size_returns_a_byte_count_or_names_the_argument(value, name, allow_none):
    """Never anything but a non-negative int, None (when allowed), or ValueError/TypeError naming
    the argument and listing the accepted forms."""
    try:
        got = cs.parse_size(value, name, allow_none=allow_none)
    except (ValueError, TypeError) as e:
        check_message(e, name, value=value)
        return
    if value is None:
        assert allow_none and got is None
        return
    assert type(got) is int and got >= 0, (value, got)
    # What was accepted is one of the documented forms, and worth what the oracle says.
    assert not isinstance(value, bool)
    if isinstance(value, int):
        assert got == value
    elif isinstance(value, float):
        assert math.isfinite(value) and value >= 0 and value.is_integer() and got == value
    else:
        assert isinstance(value, str), (type(value), value)
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        assert m is not None and m.group(2).lower() in UNITS_LOWER, value
        assert _oracle(m.group(1), m.group(2), floor=False) <= CAP, value
        assert not _fractional(m.group(1), m.group(2)), value
        assert got == _oracle(m.group(1), m.group(2)), value


# --------------------------------------------------------------------------- the constructor
def test_valid_sizes_are_parsed(no_threads_left_behind):
    with make(budget="1.5GiB", min_tensor_bytes="4KiB", host_memory_limit="512 MB") as eng:
        assert eng.budget_bytes == 3 * 2**29 and type(eng.budget_bytes) is int
        assert eng.config.budget_bytes == eng.budget_bytes
        assert eng.config.min_tensor_bytes == 4096 and type(eng.config.min_tensor_bytes) is int
        assert eng.config.host_memory_limit_bytes == 512 * 10**6
        assert eng.config.host_memory_reserve_bytes == 0      # None: nothing reserved
        assert eng.config.device_memory_limit_bytes is None
        assert eng.policy == "chameleon"           # the default once it beat the guard (issue 3)
        assert eng.device == torch.device("cpu")
    for budget, expected in [(None, None), (0, 0), (4096, 4096), ("512MB", 512 * 10**6),
                             ("1KB", 1000), ("1KiB", 1024), (2e3, 2000), ("0", 0)]:
        with make(budget=budget) as eng:
            assert eng.budget_bytes == expected
            assert eng.budget_bytes is None or type(eng.budget_bytes) is int
    # budget is the one positional argument; the rest are keyword-only.
    with cs.Chameleon("1MiB", device="cpu") as eng:
        assert eng.budget_bytes == 2**20
    with pytest.raises(TypeError):
        cs.Chameleon(None, "cpu")


def test_host_memory_reserve_is_a_size_within_the_limit(no_threads_left_behind):
    with make(host_memory_limit="64MiB", host_memory_reserve="1.5MiB") as eng:
        assert eng.config.host_memory_reserve_bytes == 3 * 2**19
        assert eng._pool.wait_reserve(timeout=60)
        assert eng.host_bytes_reserved == 3 * 2**19 and eng.host_bytes_in_use == 0
    with make(host_memory_limit="64MiB", host_memory_reserve="64MiB") as eng:  # all of it: fine
        assert eng.config.host_memory_reserve_bytes == 64 * 2**20
    for limit in ("64MiB", None):
        with pytest.raises(ValueError) as e:
            make(host_memory_limit=limit, host_memory_reserve=2**60)
        msg = str(e.value)
        assert "host_memory_reserve=" in msg and "host_memory_limit=" in msg, msg
        assert "lower host_memory_reserve or raise host_memory_limit" in msg, msg
        if limit is None:
            assert "default" in msg, msg       # says where a limit the user never set came from


def test_defaults(no_threads_left_behind):
    before = cfg.available_host_memory()
    with make() as eng:
        after = cfg.available_host_memory()
        assert eng.budget_bytes is None
        assert eng.config.min_tensor_bytes == cfg.DEFAULT_MIN_TENSOR_BYTES == 2**20
        limit = eng.config.host_memory_limit_bytes
        assert type(limit) is int and limit > 0
        if before and after:
            # Half of what was available at creation (which lies between the two readings, give
            # or take what other processes did meanwhile).
            lo, hi = min(before, after), max(before, after)
            assert 0.5 * lo - 2**30 <= limit <= 0.5 * hi + 2**30, (limit, before, after)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA here")
def test_default_device_is_cpu_without_cuda(no_threads_left_behind):
    with cs.Chameleon() as eng:
        assert eng.device == torch.device("cpu")


@pytest.mark.parametrize("value,exc,word", INVALID_VALUES, ids=INVALID_IDS)
@pytest.mark.parametrize("name", SIZE_ARGS)
def test_constructor_rejects_bad_sizes(name, value, exc, word, no_threads_left_behind):
    with pytest.raises(exc) as e:
        make(**{name: value})
    msg = check_message(e.value, name, value=value)
    assert word.lower() in msg.lower(), msg


def test_min_tensor_bytes_none_is_rejected(no_threads_left_behind):
    # None is "no limit" for the budgets, but min_tensor_bytes has no "unlimited".
    with pytest.raises(TypeError) as e:
        make(min_tensor_bytes=None)
    check_message(e.value, "min_tensor_bytes")


@pytest.mark.parametrize("policy", ["nope", "Guard", "GUARD", " guard", "guard ", "planned", "",
                                    None, 1, True, ["guard"], ("guard",), {"guard": 1}])
def test_unknown_policy(policy, no_threads_left_behind):
    with pytest.raises((ValueError, TypeError)) as e:
        make(policy=policy)
    msg = check_message(e.value, "policy", accepted=False, value=policy)
    for valid in cfg.POLICIES:
        assert repr(valid) in msg, msg           # lists every valid policy
    assert repr(policy) in msg, msg              # and says what it got


def test_every_listed_policy_constructs(no_threads_left_behind):
    assert set(cfg.POLICIES) == set(policy_pkg.POLICIES)
    for name in cfg.POLICIES:
        with make(policy=name) as eng:
            assert eng.policy == name


@pytest.mark.parametrize("limit", [0, 1, "1GiB", 2**40])
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_device_memory_limit_on_cpu_is_a_clear_error(limit, device, no_threads_left_behind):
    with pytest.raises(ValueError) as e:
        cs.Chameleon(device=device, device_memory_limit=limit)
    msg = str(e.value)
    assert re.search(r"\bdevice_memory_limit\b", msg), msg
    assert "CUDA" in msg and "cpu" in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is CUDA here")
def test_device_memory_limit_with_the_default_cpu_device(no_threads_left_behind):
    with pytest.raises(ValueError, match=r"\bdevice_memory_limit\b"):
        cs.Chameleon(device_memory_limit="1GiB")


def test_device_memory_limit_none_on_cpu_is_fine(no_threads_left_behind):
    with make(device_memory_limit=None) as eng:
        assert eng.config.device_memory_limit_bytes is None


BAD_DEVICES = [
    (5, TypeError), (["cpu"], TypeError), (1.0, TypeError),
    ("tpu", ValueError), ("meta", ValueError), ("CPU", ValueError), ("", ValueError),
    ("cuda:99", ValueError), ("cuda:-1", ValueError), ("cpu:x", ValueError),
]


@pytest.mark.parametrize("device,exc", BAD_DEVICES, ids=[repr(d) for d, _ in BAD_DEVICES])
def test_bad_device(device, exc, no_threads_left_behind):
    with pytest.raises(exc) as e:
        cs.Chameleon(device=device)
    msg = str(e.value)
    assert re.search(r"\bdevice\b", msg) and "'cpu' or 'cuda[:N]'" in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(no_threads_left_behind):
    with pytest.raises(ValueError, match=r"no CUDA device is available"):
        cs.Chameleon(device="cuda")


def test_unknown_keyword_is_a_type_error(no_threads_left_behind):
    with pytest.raises(TypeError, match="budgett"):
        cs.Chameleon(budgett="1GiB", device="cpu")


# --------------------------------------------------------------------------- nothing left behind
def test_thread_check_sees_a_real_engine():
    """The leak checks below mean something: a CPU engine does start named copy workers, and
    close() stops them."""
    before = {id(t) for t in chameleon_threads()}
    eng = make(budget="1MiB")
    started = [t for t in chameleon_threads() if id(t) not in before]
    assert sorted(t.name for t in started) == ["chameleon-d2h", "chameleon-h2d"]
    eng.close()
    for t in started:
        t.join(timeout=5)
        assert not t.is_alive()


FAILING_CONSTRUCTIONS = [
    dict(budget=-1), dict(budget="lots"), dict(budget=[1]), dict(budget=True),
    dict(min_tensor_bytes=None), dict(min_tensor_bytes=float("nan")),
    dict(host_memory_limit="-1GB"), dict(host_memory_limit={}),
    dict(device_memory_limit="1GiB"),                 # on the CPU: fails after device resolution
    dict(device_memory_limit=1j),
    dict(policy="nope"), dict(device="tpu"), dict(device=3), dict(device="cuda:99"),
    dict(budget="1GiB", policy="nope", device="tpu"),   # several bad: still one clean error
]


@pytest.mark.parametrize("kwargs", FAILING_CONSTRUCTIONS, ids=[repr(k) for k in FAILING_CONSTRUCTIONS])
def test_failed_constructor_starts_no_thread(kwargs):
    kwargs = {"device": "cpu", **kwargs}
    names_before = sorted(t.name for t in threading.enumerate())
    count_before = threading.active_count()
    with pytest.raises((ValueError, TypeError)):
        cs.Chameleon(**kwargs)
    assert threading.active_count() == count_before
    assert sorted(t.name for t in threading.enumerate()) == names_before


_INVALID_SIZE = st.one_of(
    st.integers(max_value=-1),
    st.floats(max_value=-1e-300).filter(lambda f: f < 0),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.booleans(),
    st.text(max_size=8).filter(lambda s: not re.fullmatch(r"\s*[0-9.eE+\-]*\s*[A-Za-z]*\s*", s)),
    st.sampled_from(["", "MB", "-1KB", "1PB", "1..5GB", "1e", "GiB1", "1 2 MB", "nan", "inf"]),
    st.binary(max_size=4), st.complex_numbers(), st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1), st.fractions(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(name=st.sampled_from(SIZE_ARGS), value=_INVALID_SIZE)
def test_every_invalid_size_is_rejected_by_name_and_starts_nothing(name, value):
    before = threading.active_count()
    names = sorted(t.name for t in threading.enumerate())
    try:
        eng = make(**{name: value})
    except (ValueError, TypeError) as e:
        check_message(e, name, value=value)
    else:  # pragma: no cover - only on a regression
        eng.close()
        pytest.fail(f"{name}={value!r} was accepted (parsed to {eng.config!r})")
    assert threading.active_count() == before
    assert sorted(t.name for t in threading.enumerate()) == names


@settings(max_examples=100, deadline=None)
@given(policy=st.one_of(st.text(max_size=10), st.integers(), st.none(), st.booleans(),
                        st.lists(st.text(max_size=3), max_size=2)))
def test_every_unknown_policy_is_rejected_by_name(policy):
    assume(policy not in cfg.POLICIES)
    before = threading.active_count()
    with pytest.raises((ValueError, TypeError)) as e:
        make(policy=policy)
    check_message(e.value, "policy", accepted=False, value=policy)
    assert threading.active_count() == before


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("text,expected", [("4.1MB", 4_100_000), ("1.001KB", 1001),
                                           ("1.003KB", 1003), ("2.01GB", 2_010_000_000),
                                           ("4.35KB", 4350), ("0.1GB", 10**8)])
def test_decimal_size_strings_are_exact(text, expected):
    # A float product would give 4099999, 1000, 1002, 2009999999, 4349, ...
    assert cs.parse_size(text) == expected


def test_large_integer_strings_are_exact():
    for n in (2**53 + 1, 10**19 + 7, CAP):
        assert cs.parse_size(n) == n
        assert cs.parse_size(str(n)) == n


def test_size_strings_over_the_cap_are_too_large():
    with pytest.raises(ValueError, match="too large") as e:
        cs.parse_size(str(CAP + 1), "budget")
    check_message(e.value, "budget")


# --------------------------------------------------------------------------- found here (fixed)
@pytest.mark.parametrize("text", ["1e1000000", "1e999999T", "9e999999999KB"])
def test_absurd_exponent_is_a_value_error(text):
    with pytest.raises(ValueError) as e:
        cs.parse_size(text, "budget")
    check_message(e.value, "budget", value=text)
    with pytest.raises(ValueError) as e:
        make(budget=text)
    check_message(e.value, "budget", value=text)


@pytest.mark.parametrize("n", [CAP + 1, 2**65, 10**30])
def test_huge_sizes_agree_across_forms(n):
    def outcome(v):
        try:
            return ("ok", cs.parse_size(v, "budget"))
        except (ValueError, TypeError) as e:
            return ("error", type(e))
    assert outcome(n) == outcome(str(n))
    assert outcome(float(n)) == outcome(repr(float(n)))


def test_many_digit_size_strings_round_down():
    assert cs.parse_size("0.99999999999999999999999999999KB") == 999
    assert cs.parse_size("1099511627775.9999999999KiB") == 1125899906842623
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        cs.parse_size("18446744073709551615.9999999999")

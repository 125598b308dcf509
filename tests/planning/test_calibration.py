"""The factors the mode search reads mixes that never ran at (``planning/calibration.py``)."""
import pytest

from chameleon_swap.planning.calibration import (CALIBRATION_CLAMP, MIN_CALIBRATION_RUNS,
                                                 calibrations)


def test_one_mix_that_ran_calibrates_nothing():
    assert MIN_CALIBRATION_RUNS == 2
    assert calibrations([]) == (1.0, 1.0)
    assert calibrations([(True, 1.8)]) == (1.0, 1.0)


def test_quiet_mixes_read_at_the_least_ratio_moving_ones_at_the_least_of_their_kind():
    assert calibrations([(False, 1.0), (True, 1.7)]) == (1.0, 1.7)
    assert calibrations([(False, 1.2), (True, 1.7), (True, 1.3)]) == (1.2, 1.3)
    # No moving mix ran: moving ones read as quiet ones.
    assert calibrations([(False, 1.2), (False, 1.4)]) == (1.2, 1.2)
    # A moving mix that ran fast: quiet mixes get the benefit of the doubt too.
    assert calibrations([(False, 1.2), (True, 0.9)]) == (0.9, 0.9)


def test_the_factors_are_clamped():
    lo, hi = CALIBRATION_CLAMP
    assert calibrations([(False, 0.01), (True, 0.02)]) == (lo, lo)
    assert calibrations([(False, 5.0), (True, 9.0)]) == (hi, hi)
    assert calibrations([(False, 1.0), (True, 9.0)]) == pytest.approx((1.0, hi))

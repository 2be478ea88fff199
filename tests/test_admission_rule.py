"""The one admission rule (the ledger's ``refusal``): slots, then reserved state bytes (no model)."""

from __future__ import annotations

import pytest

from mlx_voicechat_plugin.runtime.ledger import ReservationLedger
from mlx_voicechat_plugin.server.engine.admission import Admission


class NoCounter:
    def inc(self) -> None:
        pass


def test_a_full_set_of_slots_refuses_naming_max_sessions():
    assert ReservationLedger(1).refusal(1, 0) == \
        "another realtime VoiceChat session is already active"
    assert "--max-sessions 3" in ReservationLedger(3).refusal(3, 0)
    assert ReservationLedger(3).refusal(2, 0) is None


def test_a_reservation_past_the_state_budget_refuses_naming_max_state_bytes():
    ledger = ReservationLedger(8, 100)
    ledger.least = 30
    assert ledger.refusal(1, 70) is None  # 70 + the least, 30, is the budget
    assert "--max-state-bytes budget is 100" in ledger.refusal(1, 71)
    assert ledger.refusal(1, 70, need=31) is not None  # a session's own, once its options are known
    assert ledger.refusal(0, 100, need=0) is not None  # nothing is left


def test_without_a_state_budget_only_the_slots_count():
    ledger = ReservationLedger(2)
    ledger.least = 10**12
    assert ledger.refusal(1, 10**15) is None and ledger.admissible(0, 10**15) == 2


@pytest.mark.parametrize("committed, least, more", [(0, 30, 3), (10, 30, 3), (11, 30, 2),
                                                     (40, 0, 4), (100, 0, 0), (100, 30, 0)])
def test_the_count_admitted_is_what_the_rule_admits_one_after_another(committed, least, more):
    ledger = ReservationLedger(5, 100)
    ledger.least = least
    assert ledger.admissible(1, committed) == more


def test_bad_bounds_are_named():
    with pytest.raises(ValueError, match="max_sessions"):
        ReservationLedger(0)
    with pytest.raises(ValueError, match="max_state_bytes"):
        ReservationLedger(1).bound(1, 0)


def test_the_server_accepts_by_the_ledgers_rule_and_says_why_it_refused():
    ledger = ReservationLedger(2, 100)
    ledger.least = 60
    admission = Admission(ledger, NoCounter())
    assert admission.try_reserve("a") and admission.free_slots() == 0
    assert not admission.try_reserve("b")
    assert admission.refusal == ledger.refusal(1, 60)  # the same rule, the same line
    ledger.bound(2, 120)
    assert admission.free_slots() == 1 and admission.try_reserve("b")

"""The one explore/exploit rule the draft policy, batch drafting and the CPU thread count share."""

from collections import Counter

import pytest

from dflash_agent.engine.bandit import Bandit


def _play(bandit: Bandit, arms: list[str], rate: dict[str, float], seconds: dict[str, float], steps: int) -> list[str]:
    """Play `steps` steps scored by tokens per second; returns the arms played."""
    played = []
    for _ in range(steps):
        arm = bandit.choose(arms)
        bandit.record(arm, rate[arm], seconds[arm])
        played.append(arm)
    return played


def test_every_arm_is_measured_min_samples_times_in_order_first():
    bandit = Bandit(alpha=0.5, min_samples=2, budget=0.0)
    played = _play(bandit, ["a", "b", "c"], {"a": 1.0, "b": 3.0, "c": 2.0}, {"a": 1.0, "b": 1.0, "c": 1.0}, 8)
    assert played[:6] == ["a", "a", "b", "b", "c", "c"]
    assert played[6:] == ["b", "b"]  # then the best, with no budget to re-measure the others


def test_near_best_gives_only_close_arms_a_second_look():
    bandit = Bandit(alpha=0.5, min_samples=3, budget=0.0, near_best=0.5)
    played = _play(bandit, ["best", "close", "far"], {"best": 10.0, "close": 6.0, "far": 4.0},
                   {"best": 1.0, "close": 1.0, "far": 1.0}, 12)
    assert played[:7] == ["best"] * 3 + ["close"] * 3 + ["far"]  # "far" scores under half the best: once
    assert played[7:] == ["best"] * 5 and bandit.samples("far") == 1


def test_score_and_seconds_are_ewmas():
    bandit = Bandit(alpha=0.25, min_samples=1, budget=0.0)
    bandit.record("a", 8.0, 2.0)
    assert bandit.score("a") == 8.0 and bandit.estimates["a"].seconds == 2.0  # the first sample as it is
    bandit.record("a", 4.0, 1.0)
    assert bandit.score("a") == 0.75 * 8.0 + 0.25 * 4.0
    assert bandit.estimates["a"].seconds == 0.75 * 2.0 + 0.25 * 1.0
    assert bandit.samples("a") == 2 and bandit.samples("b") == 0


def test_credit_is_earned_from_step_time_and_spent_on_the_expected_loss():
    bandit = Bandit(alpha=0.5, min_samples=1, budget=0.1)
    arms = ["slow", "fast"]
    _play(bandit, arms, {"slow": 1.0, "fast": 4.0}, {"slow": 2.0, "fast": 1.0}, 2)
    assert bandit.credit == pytest.approx(0.1 * 3.0)
    # re-measuring "slow" is expected to lose 2 s * (1 - 1/4) = 1.5 s against "fast": a credit of 0.3 s
    # does not cover it
    assert bandit.expected_loss("slow", "fast") == pytest.approx(1.5)
    assert bandit.choose(arms) == "fast"
    bandit.credit = 1.5
    assert bandit.choose(arms) == "slow" and bandit.credit == 0.0


def test_the_stalest_other_arm_is_re_measured_and_a_price_can_replace_the_loss():
    bandit = Bandit(alpha=0.5, min_samples=1, budget=0.0)
    arms = ["best", "x", "y"]
    _play(bandit, arms, {"best": 4.0, "x": 1.0, "y": 1.0}, {"best": 1.0, "x": 1.0, "y": 1.0}, 3)
    bandit.credit = 10.0
    assert bandit.choose(arms) == "x"  # played before "y"
    bandit.record("x", 1.0, 1.0)
    bandit.credit = 10.0
    assert bandit.choose(arms) == "y"
    bandit.record("y", 1.0, 1.0)
    bandit.credit = 0.5
    assert bandit.choose(arms, price=lambda arm, best: 0.5) == "x" and bandit.credit == 0.0
    assert bandit.choose(arms, price=lambda arm, best: 0.5) == "best"


def test_exploring_costs_at_most_the_budget_and_finds_an_arm_that_starts_to_pay():
    bandit = Bandit(alpha=0.15, min_samples=3, budget=0.01)
    arms = ["plain", "draft"]
    seconds = {"plain": 0.02, "draft": 0.06}
    rate = {"plain": 1 / 0.02, "draft": 1 / 0.06}  # drafts that never land: a third of the speed
    played = _play(bandit, arms, rate, seconds, 3000)
    spent = Counter()
    for arm in played[6:]:
        spent[arm] += seconds[arm]
    lost = spent["draft"] * (1 - rate["draft"] / rate["plain"])
    assert 0 < lost <= 0.01 * sum(spent.values()) + seconds["draft"]
    rate["draft"] = 4 / 0.06  # now each draft step commits four tokens
    # played from then on, plain decoding re-checked often: it is close, so re-measuring it costs little
    assert 80 < _play(bandit, arms, rate, seconds, 3000)[-100:].count("draft") < 100


def test_an_unmeasured_arm_in_a_new_set_is_measured_at_once():
    bandit = Bandit(alpha=0.5, min_samples=1, budget=0.0)
    _play(bandit, ["a", "b"], {"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 1.0}, 4)
    assert bandit.choose(["a", "b", "c"]) == "c"
    assert bandit.choose(["a", "b"]) == "b"


def test_no_loss_is_expected_against_an_arm_that_scores_nothing():
    bandit = Bandit(alpha=0.5, min_samples=1, budget=0.0)
    bandit.record("a", 0.0, 1.0)
    bandit.record("b", 0.0, 1.0)
    assert bandit.expected_loss("a", "b") == 0.0

"""The agreement channel's count of splits exchanges that could carry no code:
after ``MISSES_BEFORE_GIVING_UP`` in a row every pull is agreed by an all-reduce
of its own, and an exchange that carries starts the count again (see
[Note: agreeing on each batch] in trec_pipelines.data.agreement)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from trec_pipelines.core.errors import OutOfStepError
from trec_pipelines.data.agreement import ENDED, FINE, AgreementChannel, encode


def _channel() -> AgreementChannel:
    # Every rank makes it at the same point; the conftest destroys it after the
    # test.  A rank left alone in its all-reduce fails after the timeout.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    return AgreementChannel(group, carried=True)


def test_the_channel_gives_up_carrying_after_the_misses_in_a_row() -> None:
    channel = _channel()
    waiting = channel.start(pull=0, ended=False, malformed=False)
    for _ in range(AgreementChannel.MISSES_BEFORE_GIVING_UP - 1):
        channel.missed()
    assert channel.carried
    channel.missed()
    assert not channel.carried
    # The pull that waited for a carrier is agreed by its own all-reduce.
    agreed = waiting.result()
    assert agreed.malformed_on == [] and not agreed.ended
    assert channel.take() is None


def test_an_exchange_that_carries_starts_the_count_of_misses_again() -> None:
    channel = _channel()
    waiting = channel.start(pull=0, ended=False, malformed=False)
    for _ in range(AgreementChannel.MISSES_BEFORE_GIVING_UP - 1):
        channel.missed()
    channel.carrier_found()
    assert channel.take() is waiting  # handed to the exchange, oldest first
    assert channel.take() is None  # taken once
    for _ in range(AgreementChannel.MISSES_BEFORE_GIVING_UP - 1):
        channel.missed()
    assert channel.carried
    channel.missed()
    assert not channel.carried


def test_a_pull_is_decided_once_until_other_codes_arrive() -> None:
    """The exchange and the batch source both read a carried pull: the second
    read gets the first's decision; codes delivered anew are decided anew, and
    codes out of step raise on every read."""
    channel = _channel()
    agreement = channel.start(pull=0, ended=False, malformed=False)
    ranks = channel.ranks
    others_ended = [encode(0, FINE)] + [encode(0, ENDED)] * (len(ranks) - 1)
    agreement.deliver(others_ended, ranks)
    first = agreement.result()
    assert first.ended and not first.all_ended
    assert agreement.result() is first
    agreement.deliver([encode(0, FINE)] * len(ranks), ranks)
    assert not agreement.result().ended
    agreement.deliver([encode(0, FINE)] + [encode(1, FINE)] * (len(ranks) - 1), ranks)
    for _ in range(2):
        with pytest.raises(OutOfStepError):
            agreement.result()

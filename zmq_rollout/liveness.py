"""What a client knows of its broker: is it there, is it the same one (pure; times passed in).

The client heartbeats as it connects and every ``heartbeat_interval_s`` after, and the broker
answers each with its ``Liveness`` (an epoch, new at every broker start). Any message counts
as a sign of life. No word for ``heartbeat_interval_s x broker_liveness``: the broker is *lost* (a sync step in
progress fails now; jobs wait). Lost for ``broker_timeout_s``: it is *gone* (pending calls
fail with ``BrokerUnavailableError``). A heartbeat reply from another epoch, or one saying
the broker did not know this client, means whatever was in flight is not there any more:
the client resubmits it.
"""

from __future__ import annotations

import enum

from zmq_rollout import protocol as p


class BrokerState(enum.Enum):
    OK = "ok"
    LOST = "lost"  # just now: silent past the expiry
    GONE = "gone"  # just now: lost for broker_timeout_s


class BrokerWatch:
    def __init__(self, expiry_s: float, timeout_s: float, now: float) -> None:
        self.expiry_s = expiry_s
        self.timeout_s = timeout_s
        self.epoch: str | None = None
        self.last_heard = now
        self.lost_since: float | None = None
        self.gone = False
        """Lost for ``timeout_s``: new calls fail at once, until the broker answers again."""

    def heard(self, now: float) -> bool:
        """A message came; True if the broker had been lost."""
        self.last_heard = now
        back = self.lost_since is not None
        self.lost_since, self.gone = None, False
        return back

    def liveness(self, beat: p.Liveness | None) -> bool:
        """A heartbeat reply; True if what this client had in flight must be sent again. The
        first reply only tells the epoch: it comes a round trip after the client connected (the
        first heartbeat leaves at once), and a broker that did not know the client yet is no news."""
        if beat is None:  # a broker from before epochs: only silence tells
            return False
        known, self.epoch = self.epoch, beat.epoch
        return known is not None and (beat.epoch != known or beat.new_session)

    def check(self, now: float) -> BrokerState:
        """Called every heartbeat: LOST and GONE are reported once each, when they happen."""
        if self.lost_since is None:
            if now - self.last_heard > self.expiry_s:
                self.lost_since = self.last_heard
                return BrokerState.LOST
            return BrokerState.OK
        if not self.gone and now - self.lost_since > self.timeout_s:
            self.gone = True
            return BrokerState.GONE
        return BrokerState.OK

"""The zmq-rollout broker: a pure scheduler (``scheduler``) inside a thin socket loop (``server``)."""

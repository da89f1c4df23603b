"""zmq-rollout workers: stateless processes around vLLM AsyncLLM engines."""

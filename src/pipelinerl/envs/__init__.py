"""Multi-turn rollouts: the environment worker pool (`pool`) and the actor's bookkeeping
(`rollout`). The protocol is `pipelinerl.tasks.environment`."""

"""Environments written for verifiers (0.4.0, `verifiers.v1`), trained on pipelinerl's actors.

`task.name: verifiers:<taskset id>` (docs/environments.md, "Environments from other
libraries"): `loading` builds and checks the env, `task` makes it a task, `harness` is the
in-process agent program its roles run, `episodes` runs groups of episodes against the actor's
generate endpoint and turns their traces into samples. verifiers is imported only here.
"""

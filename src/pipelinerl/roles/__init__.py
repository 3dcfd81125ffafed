"""The roles: the actor, the trainer, the evaluator and the launcher that supervises them,
each a recipe (set up, run, close) over the machinery folders below; `wiring` is what they
share (from a config to a role's streams, weights and admission). A role never imports
another role."""

"""The run's records on disk, beside the file names of `pipelinerl.records`: attempts and
group ids, checkpoints, recorded samples, eval results and snapshots, the audit that checks
nothing was lost, and deterministic replay."""

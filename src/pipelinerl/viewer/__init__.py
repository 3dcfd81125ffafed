"""`pipelinerl view RUN_DIR`: a local page to read a run's samples with their per-token
provenance (run_data: the files, read as they grow; query: filters and pages; server: the
aiohttp app; export: one view as a self-contained HTML file)."""
